"""Registers and stack of the top-k forward kernel, compiled for an H100/H200 without a GPU.

Usage (any machine with triton's NVIDIA backend, no GPU needed):
    python plugins/triton_backend/tools/topk_offline.py [--arch 90] [--json OUT]

Compiles ``kernels/topk.fwd_topk_kernel`` (the bf16 TMA path: the shipped 16-bit tile with the
launcher's rows per program, and 128 rows) for ``sm_<arch>a`` at a few ``KP`` and reads the
cubin's resource usage with the ``cuobjdump`` of the triton wheel. A non-zero stack on a
255-register kernel means spilled registers. The numbers depend on the triton version: run it
with the GPU's (the kernel's round loop is a while loop; triton 3.6 and 3.9 both compile it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusedhead_triton.configs import settings_for
from fusedhead_triton.kernels import topk
from fusedhead_triton.topk import BLOCK_M

_POINTERS = {
    "labels_ptr": "*i64", "temp_ptr": "*fp32", "ws_ptr": "*fp32", "zy_ptr": "*fp32",
    "q_ptr": "*fp32", "arg_ptr": "*i32", "starts_ptr": "*i32", "sids_ptr": "*i32",
    "zg_ptr": "*fp32", "cand_ptr": "*i64",
}  # fmt: skip
_SCALARS = {"inv_temp": "fp32", "softcap": "fp32", "inv_softcap": "fp32"}


def compile_topk(block_m: int, kp: int, arch: int) -> Any:
    """The bf16 TMA kernel for ``block_m`` rows per program and ``kp`` keys per row."""
    cfg = settings_for(torch.bfloat16).forward
    fn = topk.fwd_topk_kernel
    sig: dict[str, str] = {}
    for name in fn.arg_names:
        if name == "h_src":
            sig[name] = f"tensordesc<bf16[{block_m}, {cfg.block_k}]>"
        elif name == "w_src":
            sig[name] = f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>"
        else:
            sig[name] = _POINTERS.get(name, _SCALARS.get(name, "i32"))
    consts = dict(
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=True, USE_TMA=True, PRECISION="tf32", PER_TOKEN_T=False, HAS_SOFTCAP=False,
        HAS_Q=False, HAS_ARG=False, HAS_GATHER=False, KP=kp,
    )  # fmt: skip
    for name in consts:
        sig[name] = "constexpr"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("ws_ptr", "cand_ptr")}
    src = ASTSource(fn, sig, consts, attrs=attrs)
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def resources(compiled: Any) -> dict[str, int]:
    """Registers and stack bytes per thread, from the cubin."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    assert found, out
    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", default=None, help="write the rows here")
    opts = ap.parse_args()
    rows = []
    for block_m in (BLOCK_M, 128):
        for kp in (2, 32, 64):
            row = {"block_m": block_m, "kp": kp, **resources(compile_topk(block_m, kp, opts.arch))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if opts.json:
        meta = {"triton": triton.__version__, "arch": opts.arch, "python": sys.version.split()[0]}
        Path(opts.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
