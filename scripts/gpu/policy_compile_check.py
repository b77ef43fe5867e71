"""policy_compile_check.py OUT: ``fused_policy_loss`` inside ``torch.compile`` on one CUDA GPU.

For each backend that declares the policy loss (triton, torch), bf16 and fp16: a step compiled
with ``backend="eager"`` gives the loss, the clip fraction and both gradients of the same step in
eager mode bit for bit (the backend's call is a graph break and runs as in eager mode); compiled
with inductor (which may fuse the ops around that call), within 1e-5 relative. Writes
OUT/policy_compile_check.json; exit 1 on an error or a miss.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import fusedhead

N, H, V = 2048, 1024, 32000


def inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One RL micro-batch on the GPU: a tenth of the labels ignored, ratios around both clips."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, H, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).to(dtype)
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    labels[torch.rand(N, device="cuda", generator=g) < 0.1] = -100
    with torch.no_grad():
        lp = fusedhead.fused_head(hidden, weight, labels, backend="torch", temperature=0.7)
    old = lp.log_probs + 0.2 * torch.randn(N, device="cuda", generator=g)
    adv = torch.randn(N, device="cuda", generator=g)
    return {"hidden": hidden, "weight": weight, "labels": labels, "old": old, "adv": adv}


def run(data: dict[str, torch.Tensor], backend: str, mode: str | None) -> list[torch.Tensor]:
    """[loss, clip fraction, grad hidden, grad weight] of one step, eager (``mode`` None) or
    compiled with that ``torch.compile`` backend; the loss halved upstream."""

    def loss(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = fusedhead.fused_policy_loss(
            h, w, data["labels"], old_log_probs=data["old"], advantages=data["adv"],
            backend=backend, temperature=0.7, clip_high=0.28, entropy_coef=0.01, dual_clip=3.0,
        )  # fmt: skip
        return out.loss, out.clip_fraction

    torch._dynamo.reset()
    h = data["hidden"].clone().requires_grad_()
    w = data["weight"].clone().requires_grad_()
    fn = loss if mode is None else torch.compile(loss, backend=mode)
    value, clip = fn(h, w)
    (value * 0.5).backward()
    torch.cuda.synchronize()
    assert h.grad is not None and w.grad is not None
    return [value.detach(), clip, h.grad, w.grad]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference over the largest magnitude, in float64."""
    diff = (got.double() - want.double()).abs().max().item()
    return diff / max(want.double().abs().max().item(), 1e-30)


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for backend in ("triton", "torch"):
        for dtype in (torch.bfloat16, torch.float16):
            data = inputs(dtype)
            want = run(data, backend, None)
            for mode in ("eager", "inductor"):
                try:
                    got = run(data, backend, mode)
                    pairs = list(zip(got, want, strict=True))
                    same = [bool(torch.equal(a, b)) for a, b in pairs]
                    rel = [relative(a, b) for a, b in pairs]
                    ok = all(same) if mode == "eager" else max(rel) <= 1e-5
                    row = {"equal": same, "relative": rel, "ok": ok}
                except Exception as exc:  # recorded: the check is what failed
                    row = {"error": f"{type(exc).__name__}: {exc}"[:500], "ok": False}
                row.update(backend=backend, dtype=str(dtype), compile=mode)
                rows.append(row)
                print(json.dumps(row), flush=True)
    (out / "policy_compile_check.json").write_text(json.dumps(rows, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
