"""Registers, stack and shared memory of the top-k kernels, compiled for a GPU without one.

Usage (any machine with triton's NVIDIA backend, no GPU needed):
    python plugins/triton_backend/tools/topk_offline.py [--arch 90] [--json OUT]

Compiles ``kernels/topk.tiles_at_kernel`` (the recompute of the candidate tiles: the shipped
16-bit tile's columns, the launcher's rows per program and 128, the gathered rows by pointers
and the weight by TMA, with softcap and per-token temperature) and ``select_kernel`` (the
fold of a row's candidate logits, and of its tile maxima, at a few ``KP``) for ``sm_<arch>a``, and reads the resource usage as
tools/offline_resources.py does: a non-zero stack means spilled registers. The numbers depend
on the triton version: run it with the GPU's.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offline_resources as off
import torch

from fusedhead_triton.configs import settings_for
from fusedhead_triton.kernels import topk
from fusedhead_triton.topk import RECOMPUTE_ROWS, SELECT_ROWS, TILE_SLOT

#: The selection's keys per row: k = 1 and the k = 32, 64 of the tests (KP = padded k).
KPS = (2, 32, 64)


def compile_tiles_at(block_m: int, arch: int) -> Any:
    """``tiles_at_kernel`` for bf16 as the launcher builds it (the forward's tile and warps) with
    ``block_m`` rows per program."""
    cfg = replace(settings_for(torch.bfloat16).forward, block_m=block_m)
    signature = {
        "h_ptr": "*bf16", "w_src": f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>", "temp_ptr": "*fp32", "prog_ptr": "*i32",
        "starts_ptr": "*i64", "pairs_ptr": "*i64", "cand_ptr": "*fp32",
        **{k: "i32" for k in ("N", "V", "H", "KT", "G", "stride_hn", "stride_hk", "stride_wv",
                              "stride_wk")},
        "inv_temp": "fp32", "softcap": "fp32", "inv_softcap": "fp32",
    }  # fmt: skip
    consts = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=True, USE_TMA=True,
        PRECISION="tf32", PER_TOKEN_T=True, HAS_SOFTCAP=True,
    )  # fmt: skip
    return off._compile(topk.tiles_at_kernel, signature, consts, cfg, arch)


def compile_select(kp: int, width: int, arch: int) -> Any:
    """``select_kernel`` over slots of ``width`` columns with ``kp`` keys per row."""
    signature = {
        "cand_ptr": "*fp32", "floor_ptr": "*fp32", "keys_ptr": "*i64", "N": "i32", "KT": "i32"
    }  # fmt: skip
    consts = dict(BLOCK_R=SELECT_ROWS, BLOCK_N=width, KP=kp)
    cfg = replace(settings_for(torch.bfloat16).forward, num_warps=4, num_stages=3)
    return off._compile(topk.select_kernel, signature, consts, cfg, arch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", default="", help="write the rows here")
    opts = ap.parse_args()
    rows = []
    todo = [
        (f"tiles_at_{m}rows", 0, lambda m=m: compile_tiles_at(m, opts.arch))
        for m in (RECOMPUTE_ROWS, 128)
    ]
    bn = settings_for(torch.bfloat16).forward.block_n
    for what, width in (("select", bn), ("select_tiles", TILE_SLOT)):  # logits, tile maxima
        todo += [
            (f"{what}_kp{kp}", kp, lambda kp=kp, w=width: compile_select(kp, w, opts.arch))
            for kp in KPS
        ]
    for name, kp, build in todo:
        res = off.resources(build())
        rows.append({"name": name, "kp": kp, **asdict(res)})
        print(off.line(name, res), flush=True)
    if opts.json:
        off.write_json(opts.json, opts.arch, rows)


if __name__ == "__main__":
    main()
