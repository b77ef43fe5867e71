"""Issue 34: one GRPO policy step at the LM head of a Qwen2-shaped model, three ways.

    python scripts/gpu/policy_step_bench.py OUT_DIR                  # one GPU, bf16, V = 151936
    python scripts/gpu/policy_step_bench.py OUT_DIR --device cpu --small --backend torch   # smoke

Measured outside TRL (its dependencies do not travel to the GPU host; its kernel file is loaded
alone, as scripts/gpu/trl_grpo_bench.py does), with the same loss on every path: GRPO's
token-mean clipped surrogate (clip 0.2 / 0.2) plus beta * k3 KL to reference log-probs
(verl's ``core_algos`` formulas, TRL's ``loss_type="dapo"``). The backbone is the same whichever
head runs, so the step is the head's: hidden states ``[N, H]`` (requires grad, bf16) and the
head weight ``[V, H]`` (requires grad), forward + loss + backward:

- ``trl``: TRL's ``ChunkedLogProbFunction`` (log-probs and entropy) + the loss in torch;
- ``fusedhead``: ``lm_head_logprobs`` on the named backend + the same loss in torch;
- ``fused``: ``fusedhead.fused_policy_loss`` (the loss and its gradients in the head's pass).

Time (median, CUDA events), peak memory above the inputs, the loss and the gradients' relative
error against the ``fusedhead`` path. Writes ``OUT_DIR/policy_step_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trl_grpo_bench import load_trl_kernel, measure, trl_head

CLIP, BETA, TEMPERATURE = 0.2, 0.04, 0.7


def grpo_loss(
    lp: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Token-mean clipped surrogate + BETA * k3 KL (verl core_algos / TRL dapo)."""
    ratio = torch.exp(lp - old)
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    per_token = (surrogate + BETA * kl) * mask
    return per_token.sum() / mask.sum().clamp(min=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="triton")
    p.add_argument("--small", action="store_true", help="N=256, H=64, V=1000 (a smoke run)")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(a.device)
    n, hdim, vocab = (256, 64, 1000) if a.small else (a.n, 3584, 151936)  # Qwen2-7B's head
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden0 = torch.randn(n, hdim, generator=gen).to(device, dtype)
    head = torch.nn.Linear(hdim, vocab, bias=False).to(device, dtype)
    with torch.no_grad():
        head.weight.copy_((torch.randn(vocab, hdim, generator=gen) / hdim**0.5).to(device, dtype))
    labels = torch.randint(0, vocab, (n,), generator=gen).to(device)
    labels[: n // 8] = -100  # prompt positions
    mask = (labels != -100).float()
    adv = torch.randn(n, generator=gen).to(device)
    from fusedhead import fused_policy_loss
    from fusedhead.integrations.lm_head import lm_head_logprobs, resolve_lm_head

    fh = resolve_lm_head(a.backend)
    with torch.no_grad():  # the rollout's and the reference's log-probs, a little off the policy
        lp0 = lm_head_logprobs(head, hidden0, labels, head=fh, temperature=TEMPERATURE).log_probs
        old = (lp0 + 0.05 * torch.randn(n, generator=gen).to(device)) * mask
        ref = (lp0 + 0.05 * torch.randn(n, generator=gen).to(device)) * mask
    kernel, how = load_trl_kernel(False)
    trl_run = trl_head(kernel)

    def step(path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = hidden0.detach().requires_grad_(True)
        head.weight.grad = None
        if path == "fused":
            loss = fused_policy_loss(
                hidden, head.weight, labels, old_log_probs=old, advantages=adv,
                backend=a.backend, temperature=TEMPERATURE, clip_low=CLIP, clip_high=CLIP,
                ref_log_probs=ref, kl_coef=BETA, kl_estimator="k3", aggregation="token-mean",
            ).loss  # fmt: skip
        elif path == "trl":
            lp, _ = trl_run(head, hidden, labels, TEMPERATURE)
            loss = grpo_loss(lp, old, ref, adv, mask)
        else:
            out = lm_head_logprobs(head, hidden, labels, head=fh, temperature=TEMPERATURE)
            loss = grpo_loss(out.log_probs, old, ref, adv, mask)
        loss.backward()
        assert hidden.grad is not None and head.weight.grad is not None
        return loss.detach().float(), hidden.grad.float(), head.weight.grad.float()

    record: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "shape": {"N": n, "H": hdim, "V": vocab, "dtype": str(dtype), "ignored": n // 8},
        "loss": {"clip": CLIP, "kl_coef": BETA, "kl": "k3", "aggregation": "token-mean", "T": TEMPERATURE},
        "backend": a.backend,
        "trl_kernel": how,
        "outside_trl": "TRL's dependencies do not travel to the GPU host: the same loss, outside the trainer",
        "paths": {},
    }  # fmt: skip
    base = step("fusedhead")
    for path in ("trl", "fusedhead", "fused"):
        got = step(path)
        errors = {
            "loss_abs": float((got[0] - base[0]).abs()),
            "grad_hidden_rel": float((got[1] - base[1]).norm() / base[1].norm()),
            "grad_weight_rel": float((got[2] - base[2]).norm() / base[2].norm()),
        }
        timing = measure(lambda p=path: step(p), device, warmup=2, repeats=a.repeats)
        timing.pop("ms_all")
        record["paths"][path] = {**timing, "loss": float(got[0]), "vs_fusedhead": errors}
        print(
            f"{path:<10} {timing['ms_median']:9.2f} ms  peak {timing['peak_extra_gib']} GiB  {errors}"
        )
    (a.out / "policy_step_bench.json").write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
