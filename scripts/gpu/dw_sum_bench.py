"""The policy loss's weight-gradient update of one row chunk, ``dW += dz^T h``, on one CUDA GPU:
cuBLAS into a bf16 result (the floor: no sum kept), cuBLAS into an fp32 sum (the old path), and
the dh kernels reading dz transposed into a split sum (fp24 / exact fp32 low part), for a few
tile configurations. Also each sum's error against float64 after ``--chunks`` chunks.

    python scripts/gpu/dw_sum_bench.py OUT_DIR [--rows 1664 3456] [--chunks 4]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import torch
import triton

from fusedhead_triton import sum_format
from fusedhead_triton.configs import settings_for
from fusedhead_triton.launch import dw_chunk


def _times(rows: int, v: int, h: int, configs: dict) -> dict[str, object]:
    """ms of one chunk's update of each kind (the sum already started: a middle chunk)."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(rows)
    dz = (torch.randn(rows, v, device=dev, generator=g) * 1e-3).to(bf)
    hr = torch.randn(rows, h, device=dev, generator=g).to(bf)
    floor = torch.empty(v, h, device=dev, dtype=bf)
    acc32 = torch.mm(dz.t(), hr, out_dtype=torch.float32)
    rec: dict[str, object] = {"rows": rows, "vocab": v, "hidden": h}
    rec["cublas_bf16_ms"] = triton.testing.do_bench(
        lambda: torch.mm(dz.t(), hr, out=floor), rep=200
    )
    rec["cublas_fp32_sum_ms"] = triton.testing.do_bench(
        lambda: torch.addmm(acc32, dz.t(), hr, out_dtype=torch.float32, out=acc32), rep=200
    )
    floor = acc32 = None  # their memory back before the split sums
    for name, cfg in configs.items():
        for fmt in ("fp24", "fp32"):
            s = sum_format.allocate(v, h, bf, dev, False, fmt)
            try:
                dw_chunk(dz, hr, s, cfg, first=True, last=False)
                rec[f"dw_{name}_{fmt}_ms"] = triton.testing.do_bench(
                    lambda s=s, cfg=cfg: dw_chunk(dz, hr, s, cfg, first=False, last=False),
                    rep=200,
                )
            except Exception as e:  # a config whose tiles do not fit is recorded so
                rec[f"dw_{name}_{fmt}_ms"] = repr(e)[:200]
            del s
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--rows", type=int, nargs="+", default=[1664, 3456])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--chunks", type=int, default=4)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev, bf = torch.device("cuda"), torch.bfloat16
    shipped = settings_for(bf).dh
    configs = {
        "shipped": shipped,
        "128x128x64_s4": replace(shipped, block_n=128, num_stages=4),
        "128x256x64_g8": replace(shipped, group_m=8),
        "256x128x64_s3": replace(shipped, block_m=256, block_n=128),
    }
    v, h = a.vocab, a.hidden
    records = []
    for rows in a.rows:
        records.append(_times(rows, v, h, configs))
        print(json.dumps(records[-1]), flush=True)
        torch.cuda.empty_cache()
    # accuracy: --chunks chunks of 2048 rows at V/4 (float64 reference within memory)
    va = v // 4
    g = torch.Generator(device=dev).manual_seed(5)
    parts = [
        ((torch.randn(2048, va, device=dev, generator=g) * 1e-3).to(bf),
         torch.randn(2048, h, device=dev, generator=g).to(bf))
        for _ in range(a.chunks)
    ]  # fmt: skip
    exact = sum(dz.double().t() @ hr.double() for dz, hr in parts)
    errs = {}
    for fmt in ("fp24", "fp32", "bf16_running"):
        if fmt == "bf16_running":
            got = torch.mm(parts[0][0].t(), parts[0][1])
            for dz, hr in parts[1:]:
                got.addmm_(dz.t(), hr)
        else:
            s = sum_format.allocate(va, h, bf, dev, False, fmt)
            for i, (dz, hr) in enumerate(parts):
                dw_chunk(dz, hr, s, shipped, first=i == 0, last=i == len(parts) - 1)
            got = s.out
        errs[fmt] = float((got.double() - exact).norm() / exact.norm())
    errs["one_rounding"] = float((exact.to(bf).double() - exact).norm() / exact.norm())
    print(json.dumps({"errors": errs, "chunks": a.chunks}), flush=True)
    with open(os.path.join(a.out, "dw_sum_bench.json"), "w") as f:
        json.dump({"records": records, "errors": errs, "torch": torch.__version__,
                   "triton": triton.__version__, "device": torch.cuda.get_device_name()}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
