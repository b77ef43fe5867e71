"""Which small temperatures give finite outputs and gradients, per backend (bf16 and fp32, CUDA).

Usage (any CUDA machine with fusedhead and its torch and triton backends installed):
    python scripts/gpu/tiny_temperatures.py OUT

For each dtype, temperature and backend: whether the log-probs, the entropy and both gradients of
``log_probs.sum() + entropy.sum()`` are finite, and the same for the forward and reverse KL of the
head against a teacher of 0.9 x its hidden states (KL, dh, dW), or ``refused`` where the backend's
``min_temperature`` refuses the call. Writes OUT/tiny_temperatures.json, one row per case.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from fusedhead import fused_head, fused_kl
from fusedhead.errors import CapabilityError

N, H, V = 256, 512, 32000
TEMPERATURES = (1e-2, 1e-3, 1e-4, 1e-6, 1e-8, 1e-10, 1e-20, 2.0**-126)


def _finite(t: torch.Tensor | None) -> bool:
    return t is not None and bool(torch.isfinite(t).all())


def one_case(dtype: torch.dtype, temp: float, backend: str) -> dict[str, Any]:
    """The finiteness flags of one (dtype, temperature, backend)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h0 = torch.randn(N, H, device="cuda", generator=gen).to(dtype)
    w0 = (torch.randn(V, H, device="cuda", generator=gen) / 8).to(dtype)
    y = torch.randint(0, V, (N,), device="cuda", generator=gen)
    row: dict[str, Any] = {"dtype": str(dtype), "T": temp, "backend": backend}
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    try:
        out = fused_head(h, w, y, backend=backend, temperature=temp)
    except CapabilityError as exc:
        return {**row, "refused": exc.capability}
    (out.log_probs.sum() + out.entropy.sum()).backward()
    row.update(lp=_finite(out.log_probs), ent=_finite(out.entropy), dh=_finite(h.grad))
    row["dw"] = _finite(w.grad)
    for direction in ("forward", "reverse"):
        h.grad = w.grad = None
        kl = fused_kl(h, w, h0 * 0.9, w0, y, direction=direction, backend=backend,
                      temperature=temp, teacher_temperature=temp)  # fmt: skip
        kl.sum().backward()
        row[f"kl_{direction}"] = [_finite(kl), _finite(h.grad), _finite(w.grad)]
    return row


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("out", type=Path, help="output folder")
    out = args.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for temp in TEMPERATURES:
            for backend in ("torch", "triton"):
                rows.append(one_case(dtype, temp, backend))
                print(json.dumps(rows[-1]), flush=True)
    (out / "tiny_temperatures.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
