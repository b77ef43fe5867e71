"""Registers, stack and shared memory of the persistent dh kernel, compiled for a GPU without one.

Usage (any machine with triton's NVIDIA backend, no GPU needed):
    python plugins/triton_backend/tools/offline_resources.py [--arch 90] [--json OUT]

Compiles ``bwd_dh_tma_kernel`` for ``sm_<arch>a`` with each dh configuration of interest (the shipped
one and the ``TileConfig`` knobs) and reads the cubin's resource usage with the ``cuobjdump`` that
ships in the triton wheel. A non-zero stack on a 255-register kernel means spilled registers; the
shared memory decides how many programs fit on one SM (228 KiB on an H100/H200). This is how the
dh epilogue variants were sized before spending GPU time (docs/benchmarks.md); the numbers depend
on the triton version, so run it with the one the GPU has.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusedhead_triton.configs import TileConfig, default_configs
from fusedhead_triton.kernels import backward


@dataclass(frozen=True)
class Resources:
    registers: int
    stack_bytes: int
    shared_bytes: int


def cuobjdump() -> str:
    """The cuobjdump bundled with triton's NVIDIA backend (FileNotFoundError if absent)."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no cuobjdump in this triton install ({path})")
    return path


#: Element types of the sum's (high, low) parts for each SUM_LO (launch.SUM_FORMATS).
SUM_TYPES = {0: ("bf16", "bf16"), 16: ("i16", "i16"), 8: ("i16", "i8")}


def compile_dh(
    cfg: TileConfig, *, arch: int = 90, first: bool = False, last: bool = False, sum_lo: int = 0
) -> Any:
    """``bwd_dh_tma_kernel`` for bf16 with a split sum (``sum_lo``), as the launcher builds it."""
    splits = cfg.epilogue_splits
    hi_ty, lo_ty = SUM_TYPES[sum_lo]
    shape = f"[{cfg.block_m}, {cfg.block_n // splits}]"
    kernel = backward.bwd_dh_tma_kernel
    signature: dict[str, str] = {
        "dz_desc": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>",
        "w_desc": f"tensordesc<bf16[{cfg.block_k}, {cfg.block_n}]>",
        "acc_ptr": f"*{hi_ty}",
        "lo_ptr": f"*{lo_ty}",
        "out_ptr": "*bf16",
        "acc_desc": f"tensordesc<{hi_ty}{shape}>" if cfg.tma_sum else "constexpr",
        "lo_desc": f"tensordesc<{lo_ty}{shape}>" if cfg.tma_sum else "constexpr",
        "out_desc": f"tensordesc<bf16{shape}>" if cfg.tma_sum else "constexpr",
        "N": "i32",
        "H": "i32",
        "Kb": "i32",
    }
    consts: dict[str, Any] = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_PROGS=132 * cfg.programs_per_sm, PRECISION="tf32", FIRST=first, LAST=last, SPLIT=True,
        SUM_LO=sum_lo, FLATTEN=cfg.flatten, EPILOGUE_SPLITS=splits, PREFETCH=cfg.prefetch_sum,
        WARP_SPECIALIZE=cfg.warp_specialize, TMA_SUM=cfg.tma_sum,
    )  # fmt: skip
    if not cfg.tma_sum:
        consts.update(acc_desc=None, lo_desc=None, out_desc=None)
    signature.update({k: "constexpr" for k in consts})
    names = list(kernel.arg_names)
    src = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in consts.items()},
    )
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def resources(compiled: Any) -> Resources:
    """Registers and stack from the cubin, shared memory from triton's metadata."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run(
            [cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    match = re.search(r"REG:(\d+)\s+STACK:(\d+)", out)
    if match is None:
        raise RuntimeError(f"no resource line in cuobjdump's output:\n{out}")
    return Resources(int(match[1]), int(match[2]), int(compiled.metadata.shared))


def candidates() -> dict[str, tuple[TileConfig, int]]:
    """The shipped dh config, the knobs tried on the H200 (docs/benchmarks.md) and the sum
    formats: name -> (config, SUM_LO)."""
    import torch

    shipped = default_configs(torch.bfloat16).dh
    base = replace(shipped, epilogue_splits=1)
    return {
        "whole_tile": (base, 0),
        "shipped": (shipped, 0),
        "shipped_fp32_sum": (shipped, 16),
        "shipped_fp24_sum": (shipped, 8),
        "quarters": (replace(base, epilogue_splits=4), 0),
        "tma_sum_halves": (replace(base, epilogue_splits=2, tma_sum=True), 0),
        "tma_sum_fp24": (replace(base, epilogue_splits=2, tma_sum=True), 8),
        "two_per_sm_128x128": (
            replace(
                base, block_n=128, num_stages=2, epilogue_splits=2, tma_sum=True, programs_per_sm=2
            ),
            0,
        ),
    }


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    args.add_argument("--only", default="", help="comma-separated candidate names")
    args.add_argument("--json", default="", help="write the table here too")
    opts = args.parse_args()
    only = {x for x in opts.only.split(",") if x}
    rows = []
    for name, (cfg, sum_lo) in candidates().items():
        if only and name not in only:
            continue
        res = resources(compile_dh(cfg, arch=opts.arch, sum_lo=sum_lo))
        rows.append({"name": name, "config": asdict(cfg), "sum_lo": sum_lo, **asdict(res)})
        print(
            f"{name:22s} regs {res.registers:3d}  stack {res.stack_bytes:5d} B  "
            f"shared {res.shared_bytes / 1024:6.1f} KiB",
            flush=True,
        )
    if opts.json:
        meta = {"triton": triton.__version__, "arch": opts.arch, "python": sys.version.split()[0]}
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
