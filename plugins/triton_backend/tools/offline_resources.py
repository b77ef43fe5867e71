"""Registers, stack and shared memory of the persistent dh kernel, compiled for a GPU without one.

Usage (any machine with triton's NVIDIA backend, no GPU needed):
    python plugins/triton_backend/tools/offline_resources.py [--arch 90] [--json OUT]

Compiles ``dh_tma_kernel`` (and ``dz_kernel`` on its TMA path) for ``sm_<arch>a`` with the shipped tiles and a
few others, for each sum format, and reads the cubin's resource usage with the ``cuobjdump`` that
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

from fusedhead_triton.configs import TileConfig, settings_for
from fusedhead_triton.kernels import dh, dz


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


#: Element types of the sum's (high, low) parts for each SUM_LO (sum_format.SUM_LO).
SUM_TYPES = {0: ("fp32", "fp32"), 16: ("i16", "i16"), 8: ("i16", "i8")}


def _compile(
    kernel: Any, signature: dict[str, str], consts: dict[str, Any], cfg: TileConfig, arch: int
) -> Any:
    signature.update({k: "constexpr" for k in consts})
    names = list(kernel.arg_names)
    src = ASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()}
    )
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _tiles(cfg: TileConfig) -> dict[str, Any]:
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m, NUM_PROGS=132, PRECISION="tf32")  # fmt: skip


def compile_dh(
    cfg: TileConfig, *, arch: int = 90, first: bool = False, last: bool = False, sum_lo: int = 8
) -> Any:
    """``dh_tma_kernel`` for bf16 with the sum format ``sum_lo``, as the launcher builds it."""
    hi_ty, lo_ty = SUM_TYPES[sum_lo]
    signature = {
        "dz_desc": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>",
        "w_desc": f"tensordesc<bf16[{cfg.block_k}, {cfg.block_n}]>",
        "hi_ptr": f"*{hi_ty}", "lo_ptr": f"*{lo_ty}", "out_ptr": "*bf16",
        "N": "i32", "H": "i32", "Kb": "i32",
    }  # fmt: skip
    consts = {**_tiles(cfg), "FIRST": first, "LAST": last, "SUM_LO": sum_lo}
    return _compile(dh.dh_tma_kernel, signature, consts, cfg, arch)


def compile_dz(cfg: TileConfig, *, arch: int = 90, entropy: bool = True) -> Any:
    """``dz_kernel``'s TMA path for bf16 with both output gradients, as the launcher builds it."""
    signature = {
        "h": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>",
        "w": f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>",
        "dz": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_n}]>",
        **{k: "*i64" if k == "labels_ptr" else "*fp32" for k in
           ("labels_ptr", "temp_ptr", "norm_ptr", "lp_ptr", "ent_ptr", "glp_ptr", "gent_ptr")},
        "ax_ptr": "*fp32", "c_ptr": "*fp32", "starts_ptr": "*i32", "sids_ptr": "*i32",
        "gs_ptr": "*fp32",
        "N": "i32", "Vb": "i32", "H": "i32",
        **dict.fromkeys(("stride_hn", "stride_hk", "stride_wv", "stride_wk", "stride_dzm"), "i32"),
        "label_offset": "i32", "ignore_index": "i32",
        "inv_temp": "fp32", "softcap": "fp32", "inv_softcap": "fp32", "K_sp": "i32",
        "col0": "i32",
    }  # fmt: skip
    consts = {**_tiles(cfg), "TMA": True, "EVEN_K": True, "PER_TOKEN_T": False,
              "HAS_SOFTCAP": False, "HAS_GLP": True,
              "HAS_GENT": entropy, "HAS_AX": False, "HAS_C": False,
              "HAS_SPARSE": False}  # fmt: skip
    return _compile(dz.dz_kernel, signature, consts, cfg, arch)


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


def line(label: str, res: Resources, width: int = 22) -> str:
    """One row of the printed table."""
    return (
        f"{label:{width}s} regs {res.registers:3d}  stack {res.stack_bytes:5d} B  "
        f"shared {res.shared_bytes / 1024:6.1f} KiB"
    )


def write_json(path: str, arch: int, rows: list[dict[str, Any]]) -> None:
    """The table with the triton version and the architecture it was compiled for."""
    meta = {"triton": triton.__version__, "arch": arch, "python": sys.version.split()[0]}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def candidates() -> dict[str, tuple[str, TileConfig, int]]:
    """name -> (kernel, config, SUM_LO): the shipped tiles and narrower ones, every sum format."""
    import torch

    shipped = settings_for(torch.bfloat16).dh
    narrow = replace(shipped, block_n=128)
    return {
        "dh_fp24": ("dh", shipped, 8),
        "dh_fp32": ("dh", shipped, 16),
        "dh_fp32_out": ("dh", shipped, 0),
        "dh_128x128_fp24": ("dh", narrow, 8),
        "dh_128x128_4stages_fp24": ("dh", replace(narrow, num_stages=4), 8),
        "dz": ("dz", shipped, 0),
    }


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    args.add_argument("--only", default="", help="comma-separated candidate names")
    args.add_argument("--json", default="", help="write the table here too")
    opts = args.parse_args()
    only = {x for x in opts.only.split(",") if x}
    rows = []
    for name, (which, cfg, sum_lo) in candidates().items():
        if only and name not in only:
            continue
        if which == "dz":
            res = resources(compile_dz(cfg, arch=opts.arch))
        else:
            res = resources(compile_dh(cfg, arch=opts.arch, sum_lo=sum_lo))
        rows.append({"name": name, "config": asdict(cfg), "sum_lo": sum_lo, **asdict(res)})
        print(line(name, res), flush=True)
    if opts.json:
        write_json(opts.json, opts.arch, rows)


if __name__ == "__main__":
    main()
