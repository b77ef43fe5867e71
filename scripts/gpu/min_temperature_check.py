"""How far each backend is from float64 at and near triton's ``min_temperature``, side by side.

Usage (any CUDA machine with fusedhead and its torch and triton backends installed; ``--device
cpu`` with ``TRITON_INTERPRET=1`` rehearses it in fp32):
    python scripts/gpu/min_temperature_check.py OUT [--device cuda]

For each dtype and temperature, on the same inputs: the log-probs', the entropy's and the KL's
(forward and reverse, against a teacher head) error relative to the largest float64 value, and
the student gradients' error in norm relative to the float64 gradient's norm, for ``torch`` and
``triton``. The inputs are rounded to the dtype first, so the float64 reference sees the values
the backends see. ``torch`` (fp32 logits, then log-softmax) is the yardstick: a backend as
accurate as fp32 arithmetic allows is within a small factor of it at every temperature, where
``tiny_temperatures.py`` only asks whether outputs are finite. Writes
OUT/min_temperature_check.json, one row per (dtype, temperature, backend).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from fusedhead import fused_head, fused_kl

#: triton's floor (``fusedhead_triton.backend.MIN_TEMPERATURE``), twice it, ten times, a hundred.
TEMPERATURES = (1e-3, 2e-3, 1e-2, 1e-1)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _rel(got: torch.Tensor | None, want: torch.Tensor) -> float:
    """Largest error over the largest reference value (values), or error norm over norm (grads)."""
    assert got is not None
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    if g.dim() == 1:
        return float((g - w).abs().max() / w.abs().max().clamp_min(1e-300))
    return float((g - w).norm() / w.norm().clamp_min(1e-300))


def _inputs(n: int, h: int, v: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """(hidden, weight, teacher hidden, teacher weight, labels): logits of a few units at T = 1."""
    g = torch.Generator().manual_seed(61)
    hs, ht = torch.randn(n, h, generator=g), torch.randn(n, h // 2 + 1, generator=g)
    ws = torch.randn(v, h, generator=g) * (2 / h**0.5)
    wt = torch.randn(v, h // 2 + 1, generator=g) * (2 / (h // 2 + 1) ** 0.5)
    y = torch.randint(0, v, (n,), generator=g)
    return [t.to(dtype).to(device) for t in (hs, ws, ht, wt)] + [y.to(device)]


def _reference(
    hs: torch.Tensor, ws: torch.Tensor, ht: torch.Tensor, wt: torch.Tensor, y: torch.Tensor,
    temp: float, gv: torch.Tensor,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """float64 full-logits values and the student's gradients of ``sum(gv * value)``."""
    out: dict[str, torch.Tensor] = {}
    for name in ("head", "kl_forward", "kl_reverse"):
        h = hs.detach().double().cpu().requires_grad_()
        w = ws.detach().double().cpu().requires_grad_()
        ls = torch.log_softmax(h @ w.T / temp, -1)
        if name == "head":
            lp = ls.gather(1, y.cpu()[:, None])[:, 0]
            ent = -(ls.exp() * ls).sum(-1)
            value, loss = torch.stack([lp, ent]), (gv * lp + gv.flip(0) * ent).sum()
        else:
            lt = torch.log_softmax(ht.double().cpu() @ wt.double().cpu().T / temp, -1)
            a, b = (lt, ls) if name == "kl_forward" else (ls, lt)
            value = (a.exp() * (a - b)).sum(-1)
            loss = (gv * value).sum()
        loss.backward()
        assert h.grad is not None and w.grad is not None
        out[name], out[name + "_dh"], out[name + "_dw"] = value.detach(), h.grad, w.grad
    return out


def one_case(
    backend: str, dtype: str, temp: float, data: list[torch.Tensor], ref: dict[str, torch.Tensor],
    gv: torch.Tensor,
) -> dict[str, Any]:  # fmt: skip
    """The errors of one (backend, dtype, temperature) against ``ref``."""
    hs0, ws0, ht, wt, y = data
    row: dict[str, Any] = {"backend": backend, "dtype": dtype, "T": temp}
    g = gv.to(hs0.device)
    for name in ("head", "kl_forward", "kl_reverse"):
        hs, ws = hs0.clone().requires_grad_(), ws0.clone().requires_grad_()
        if name == "head":
            out = fused_head(hs, ws, y, backend=backend, temperature=temp)
            value = torch.stack([out.log_probs, out.entropy])
            (g * out.log_probs + g.flip(0) * out.entropy).sum().backward()
        else:
            direction = name.removeprefix("kl_")
            value = fused_kl(hs, ws, ht, wt, y, direction=direction, backend=backend,
                             temperature=temp, teacher_temperature=temp)  # fmt: skip
            (g * value).sum().backward()
        if name == "head":
            row["log_probs"] = _rel(value[0], ref[name][0])
            row["entropy"] = _rel(value[1], ref[name][1])
        else:
            row[name] = _rel(value, ref[name])
        row[name + "_dh"] = _rel(hs.grad, ref[name + "_dh"])
        row[name + "_dw"] = _rel(ws.grad, ref[name + "_dw"])
    return row


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("out", type=Path, help="output folder")
    args.add_argument("--device", default="cuda")
    ns = args.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    n, h, v = (256, 512, 32000) if ns.device == "cuda" else (32, 64, 1000)
    gv = torch.randn(n, generator=torch.Generator().manual_seed(62), dtype=torch.float64)
    rows: list[dict[str, Any]] = []
    for dtype in ("bf16", "fp32") if ns.device == "cuda" else ("fp32",):
        data = _inputs(n, h, v, DTYPES[dtype], ns.device)
        for temp in TEMPERATURES:
            ref = _reference(*data, temp, gv)
            pair = [one_case(b, dtype, temp, data, ref, gv.float()) for b in ("torch", "triton")]
            errors = [k for k, x in pair[0].items() if isinstance(x, float) and k != "T"]
            ratio = {k: pair[1][k] / max(pair[0][k], 1e-30) for k in errors}
            rows += [*pair, {"backend": "triton / torch", "dtype": dtype, "T": temp, **ratio}]
            for r in rows[-3:]:
                print(json.dumps({k: f"{x:.2e}" if k in errors else x for k, x in r.items()}))
    (ns.out / "min_temperature_check.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
