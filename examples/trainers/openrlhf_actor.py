"""OpenRLHF with fusedhead, offline on the CPU: the actor's log-probs beside OpenRLHF's own forward.

    FUSED_HEAD_BACKEND=fusedhead:torch .venv/bin/python examples/trainers/openrlhf_actor.py
    .venv/bin/python examples/trainers/openrlhf_actor.py [--backend NAME]

OpenRLHF has no config field for the head; the backend name comes from the setting its launcher
recipe reads (``FUSED_HEAD_BACKEND``, docs/integrations/openrlhf.md; ``--backend`` overrides it)
and goes to ``patch_actor``. Two ``openrlhf.models.actor.Actor`` instances load the same tiny Llama
(tiny.py) with OpenRLHF's ``packing_samples``; one is patched. The action log-probs, entropy
and gradients of a left/right-padded batch are printed side by side. flash-attn cannot be built
without CUDA, and OpenRLHF imports four padding helpers from it: where it is absent, the
stand-in in tests/trainers/openrlhf_stubs goes on the path. About 10 s on two cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tiny import add_backend_flag, scaled_diff, tiny_model  # noqa: E402

VOCAB = 53


def import_actor() -> Any:
    """OpenRLHF's ``Actor`` (flash-attn's padding helpers stood in for where it is absent)."""
    if importlib.util.find_spec("flash_attn") is None:
        sys.path.insert(0, str(HERE.parents[1] / "tests" / "trainers" / "openrlhf_stubs"))
    from openrlhf.models.actor import Actor

    return Actor


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts, right-padded responses, as OpenRLHF's experience maker builds them."""
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(1, VOCAB, (3, 14), generator=g)
    mask = torch.ones_like(seq)
    mask[0, :3] = 0
    mask[1, :1] = 0
    mask[1, 12:] = 0
    mask[2, 10:] = 0
    return seq.masked_fill(mask == 0, 0), mask, mask[:, -6:].clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env = os.environ.get("FUSED_HEAD_BACKEND", "")  # set but empty: as unset
    try:
        add_backend_flag(parser, env or "torch")
    except argparse.ArgumentTypeError as exc:
        parser.error(f"environment variable FUSED_HEAD_BACKEND={env!r}: {exc}")
    backend = parser.parse_args().backend
    flag = any(a == "--backend" or a.startswith("--backend=") for a in sys.argv[1:])
    source = "--backend" if flag else "FUSED_HEAD_BACKEND" if env else "the default"
    actor_cls = import_actor()
    from fusedhead.integrations.openrlhf import patch_actor

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-llama"
        tiny_model("llama", VOCAB, pad_token_id=0).save_pretrained(path)

        def actor() -> Any:  # OpenRLHF loads bf16 or fp16 weights; this example runs in fp32
            kw = dict(attn_implementation="eager", param_dtype="bf16", packing_samples=True)
            return actor_cls(str(path), temperature=0.8, **kw).float()

        theirs, ours = actor(), actor()
    head = patch_actor(ours, backend)  # the one opt-in line
    print(f"fusedhead backend: {head.name!r} ({backend!r}, from {source})")
    seq, mask, action_mask = batch()
    needed = mask[:, 1:].bool()  # positions whose next token is real (what the losses read)
    results = {}
    for name, a in (("theirs", theirs), ("ours", ours)):
        lp, out = a(seq, action_mask, attention_mask=mask, return_output=True, return_entropy=True)
        (lp.sum() + 0.1 * (out.entropy * needed).sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in a.parameters() if p.grad is not None])
        results[name] = {
            "log_probs": lp.detach(),
            "entropy": out.entropy.detach()[needed],
            "gradients": grads,
        }
    print(f"{'output':<10} {'OpenRLHF Actor':>20} {'patched: ' + backend:>26} {'diff (1)':>11}")
    worst = 0.0
    for key in ("log_probs", "entropy", "gradients"):
        a, b = results["theirs"][key], results["ours"][key]
        diff = scaled_diff(b, a)
        worst = max(worst, diff)
        sa, sb = float(a.double().sum()), float(b.double().sum())
        print(
            f"{key:<10} {'sum ' + format(sa, '.7f'):>20} {'sum ' + format(sb, '.7f'):>26} {diff:>11.1e}"
        )
    print("(1) max |diff| / max(1, max |OpenRLHF's value|), checked against 1e-5")
    if worst > 1e-5:
        raise SystemExit(f"fusedhead and OpenRLHF's forward disagree by {worst:.2e} (1)")


if __name__ == "__main__":
    main()
