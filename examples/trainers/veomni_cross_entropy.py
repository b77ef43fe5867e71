"""VeOmni with fusedhead, offline on the CPU: its loss and log-probs beside VeOmni's chunk_loss.

    .venv/bin/python examples/trainers/veomni_cross_entropy.py [--backend NAME]

The backend is named in VeOmni's own config (``ops_implementation.
cross_entropy_loss_implementation``, the ``OpsImplementationConfig`` field). The same tiny Qwen2
is built twice by VeOmni's ``build_foundation_model``, once with fusedhead and once with
VeOmni's own ``chunk_loss``; on one packed row (VeOmni's PackingCollator layout) the training
loss, the per-token log-probs and entropy (``return_log_probs=True``, what verl's VeOmni engine
and VeOmni's DPO read) and the gradients are printed side by side. About 10 s on two cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import add_backend_flag, scaled_diff, tiny_config

VOCAB, IGNORE = 256, -100


def build(impl: str, state: dict[str, torch.Tensor] | None) -> Any:
    """A tiny Qwen2 from VeOmni's ``build_foundation_model``, ``impl`` as its loss kernel."""
    from veomni.arguments.arguments_types import OpsImplementationConfig
    from veomni.models import build_foundation_model

    ops = OpsImplementationConfig(  # VeOmni's config: every other op its eager one (the CPU)
        attn_implementation="eager",
        cross_entropy_loss_implementation=impl,
        rms_norm_implementation="eager",
        swiglu_mlp_implementation="eager",
        rotary_pos_emb_implementation="eager",
        moe_implementation="eager",
        load_balancing_loss_implementation="eager",
    )
    config = tiny_config("qwen2", VOCAB, architectures=["Qwen2ForCausalLM"])
    model = build_foundation_model(
        config, torch_dtype="float32", init_device="cpu", ops_implementation=ops
    )
    with torch.no_grad():
        if state is None:
            gen = torch.Generator().manual_seed(0)
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        else:
            model.load_state_dict(state)
    return model


def packed_row(lengths: list[int]) -> dict[str, torch.Tensor]:
    """One packed row: positions restart per sequence, each sequence's first label ignored."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=gen)
    labels = input_ids.clone()
    labels[0, torch.tensor([0, *lengths[:-1]]).cumsum(0)] = IGNORE
    return {
        "input_ids": input_ids,
        "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
        "labels": labels,
        "shift_labels": torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:],
    }


def run(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The loss, then log-probs and entropy at T = 0.7, with the gradients of both."""
    loss = model(**batch).loss
    loss.backward()
    out = {"loss": loss.detach()}
    aux = model(**batch, return_log_probs=True, temperature=0.7).fused_linear_aux
    (aux.log_probs.sum() + 0.3 * aux.entropy.sum()).backward()
    out["log_probs"], out["entropy"] = aux.log_probs.detach(), aux.entropy.detach()
    out["gradients"] = torch.cat([p.grad.flatten() for p in model.parameters()])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_backend_flag(parser)
    backend = parser.parse_args().backend

    from fusedhead.integrations import veomni as fh_veomni

    fh_veomni.install()  # once, before the model is built (VeOmni has no plugin entry points)
    batch = packed_row([6, 9, 4])
    theirs_model = build("chunk_loss", None)
    theirs = run(theirs_model, batch)
    ours = run(build(backend, theirs_model.state_dict()), batch)
    print(f"packed row: 3 sequences, {int((batch['shift_labels'] != IGNORE).sum())} scored tokens")
    print(f"{'output':<10} {'VeOmni chunk_loss':>20} {backend:>20} {'diff (1)':>11}")
    worst = 0.0
    for key in ("loss", "log_probs", "entropy", "gradients"):
        diff = scaled_diff(ours[key], theirs[key])
        worst = max(worst, diff)
        a, b = float(theirs[key].double().sum()), float(ours[key].double().sum())
        print(
            f"{key:<10} {'sum ' + format(a, '.7f'):>20} {'sum ' + format(b, '.7f'):>20} {diff:>11.1e}"
        )
    print("(1) max |diff| / max(1, max |VeOmni's value|), checked against 1e-5")
    if worst > 1e-5:
        raise SystemExit(f"fusedhead and VeOmni's chunk_loss disagree by {worst:.2e} (1)")


if __name__ == "__main__":
    main()
