"""The triton KL of two heads on a GPU: forward and backward time of a few tile configurations.

Usage on a CUDA machine (writes kl_sweep.json to OUT_DIR and prints a table):
    python plugins/triton_backend/tools/kl_sweep.py OUT_DIR [--n 8192] [--budget-s 300]
    python plugins/triton_backend/tools/kl_sweep.py OUT_DIR --dry   # CPU interpreter, tiny shapes

Each configuration (the tile of both the stats and the dz kernel, both heads' 128 x 128 tiles at
once; the forward's chunk of vocabulary tiles) is timed with
``triton.testing.do_bench`` in GEMM units (one cuBLAS ``hidden @ weight.T`` of the shape, timed
beside them): the forward (stats + combine), the backward (dz blocks + dh + cuBLAS dW through
``backward_from``) and their sum, both directions for the shipped configuration. Targets (issue 18, H200 bf16, N = 8192, H = 4096, V = 151936): forward
<= 2.2 units, forward + backward <= 6.5. Each configuration's KL is checked against the shipped
one's (a broken tile shows as an error, not a fast time). A configuration that fails to compile
is reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("out", help="output folder (kl_sweep.json)")
ARGS.add_argument("--n", type=int, default=8192)
ARGS.add_argument("--hidden", type=int, default=4096)
ARGS.add_argument("--vocab", type=int, default=151936)
ARGS.add_argument("--dry", action="store_true", help="CPU interpreter, tiny shapes")
ARGS.add_argument("--budget-s", type=float, default=300.0, help="stop after this many seconds")
OPTS = ARGS.parse_args()
if OPTS.dry:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from fusedhead_triton import TritonBackend  # noqa: E402
from fusedhead_triton.configs import TileConfig  # noqa: E402
from fusedhead_triton.kl import (  # noqa: E402
    CHUNK,
    KLScalars,
    kl_grads,
    kl_tile,
    kl_values,
)

DEV = torch.device("cpu" if OPTS.dry else "cuda")
DTYPE = torch.float16 if OPTS.dry else torch.bfloat16


@dataclass(frozen=True)
class Run:
    """One timed configuration of one direction."""

    name: str
    cfg: TileConfig
    reverse: bool = False
    chunk: int = CHUNK


def runs(forward: TileConfig) -> list[Run]:
    """The shipped tile in both directions first, then one change at a time, the likeliest gains
    first (the budget may stop the list)."""
    shipped = kl_tile(forward)
    out = [Run("shipped", shipped), Run("shipped", shipped, reverse=True)]
    changes: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("stages=3", {"num_stages": 3}, {}),
        ("group_m=16", {"group_m": 16}, {}),
        ("pointers", {"tma": False}, {}),
    ]
    out += [Run(name, replace(shipped, **c), **kw) for name, c, kw in changes]
    return out


def bench(fn: Any) -> float:
    """Median milliseconds of ``fn``."""
    if OPTS.dry:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def main() -> int:
    n, h, v = (64, 64, 1000) if OPTS.dry else (OPTS.n, OPTS.hidden, OPTS.vocab)
    g = torch.Generator(device=DEV).manual_seed(0)
    hs = torch.randn(n, h, generator=g, device=DEV).to(DTYPE)
    ws = (torch.randn(v, h, generator=g, device=DEV) / h**0.5).to(DTYPE)
    ht = torch.randn(n, h, generator=g, device=DEV).to(DTYPE)
    wt = (torch.randn(v, h, generator=g, device=DEV) * 2 / h**0.5).to(DTYPE)
    valid = torch.ones(n, dtype=torch.bool, device=DEV)
    coef = torch.randn(n, generator=g, device=DEV)
    st = TritonBackend()._settings(DTYPE)[0]
    unit = bench(lambda: hs @ ws.T)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    want: dict[bool, torch.Tensor] = {}
    for run in runs(st.forward):
        name, cfg, chunk, reverse = run.name, run.cfg, run.chunk, run.reverse
        if time.perf_counter() - start > OPTS.budget_s:
            print(f"budget of {OPTS.budget_s:.0f} s spent: {name} and the rest not run")
            break
        sc = KLScalars(1 / 0.7, 1.0, None, None, reverse)
        row: dict[str, Any] = {"name": name, "reverse": reverse, "chunk": chunk}
        row.update(asdict(cfg))
        try:
            kl, norm = kl_values(hs, ws, ht, wt, valid, None, None, sc, cfg, chunk)
            if reverse not in want:
                want[reverse] = kl
            row["kl_rel_err_vs_shipped"] = float((kl - want[reverse]).norm() / want[reverse].norm())

            fwd = partial(kl_values, hs, ws, ht, wt, valid, None, None, sc, cfg, chunk)
            bwd = partial(kl_grads, hs, ws, ht, wt, None, None, norm, coef, sc, st,
                          cfg, need_dh=True, need_dw=True)  # fmt: skip
            row["fwd_units"] = bench(fwd) / unit
            row["bwd_units"] = bench(bwd) / unit
            row["fwd_bwd_units"] = row["fwd_units"] + row["bwd_units"]
        except Exception as exc:  # a tile that does not compile or does not fit: say so, go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        line = ", ".join(
            f"{k} {row[k]:.3g}" if isinstance(row.get(k), float) else f"{k} {row[k]}"
            for k in ("fwd_units", "bwd_units", "fwd_bwd_units", "kl_rel_err_vs_shipped", "error")
            if k in row
        )
        print(f"{name:10s} {'reverse' if reverse else 'forward'}: {line}", flush=True)
    result = {
        "shape": {"n": n, "h": h, "v": v, "dtype": str(DTYPE)},
        "device": torch.cuda.get_device_name(DEV) if DEV.type == "cuda" else "cpu interpreter",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gemm_unit_ms": unit,
        "rows": rows,
    }
    os.makedirs(OPTS.out, exist_ok=True)
    with open(os.path.join(OPTS.out, "kl_sweep.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"GEMM unit {unit:.3f} ms; wrote {os.path.join(OPTS.out, 'kl_sweep.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
