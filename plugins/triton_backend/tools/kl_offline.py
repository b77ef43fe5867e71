"""Registers, stack and shared memory of the KL kernels, compiled for a GPU without one.

Usage (any machine with triton's NVIDIA backend, no GPU needed):
    python plugins/triton_backend/tools/kl_offline.py [--arch 90] [--json OUT]

Compiles ``kl_stats_kernel`` and ``kl_dz_kernel`` (bf16, TMA, both directions) for ``sm_<arch>a``
with the shipped KL tile and the sweep's alternatives (tools/kl_sweep.py), and reads the
resource usage as tools/offline_resources.py does: a non-zero stack means spilled registers, the
shared memory must fit one program per SM (228 KiB on an H100/H200). Both heads' fp32
accumulators are live at once, which is what bounds the KL tile.
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

from fusedhead_triton.configs import TileConfig, settings_for
from fusedhead_triton.kernels import kl
from fusedhead_triton.kl import CHUNK, kl_tile

_HEADS = ("hs", "ws", "ht", "wt")
_STRIDES = tuple(f"stride_{x}" for x in ("hsn", "hsk", "wsv", "wsk", "htn", "htk", "wtv", "wtk"))
_SCALARS = ("inv_temp_s", "inv_temp_t", "softcap_s", "inv_softcap_s", "softcap_t", "inv_softcap_t")


def _descriptors(cfg: TileConfig) -> dict[str, str]:
    a = f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>"
    b = f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>"
    return dict(zip(_HEADS, (a, b, a, b)))


def _consts(cfg: TileConfig, reverse: bool, fuse_k: bool) -> dict[str, Any]:
    return dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_PROGS=132, TMA=True, FUSE_K=fuse_k, EVEN_KS=True, EVEN_KT=True, PRECISION="tf32",
        PER_TOKEN_TS=False, PER_TOKEN_TT=False, SOFTCAP_S=False, SOFTCAP_T=False, REVERSE=reverse,
    )  # fmt: skip


def compile_stats(cfg: TileConfig, *, arch: int, reverse: bool, fuse_k: bool) -> Any:
    """``kl_stats_kernel`` as the launcher builds it for bf16 heads of equal H."""
    signature = {
        **_descriptors(cfg), "temp_s_ptr": "*fp32", "temp_t_ptr": "*fp32", "out_ptr": "*fp32",
        "N": "i32", "V": "i32", "HS": "i32", "HT": "i32", **dict.fromkeys(_STRIDES, "i32"),
        **dict.fromkeys(_SCALARS, "fp32"),
    }  # fmt: skip
    consts = {**_consts(cfg, reverse, fuse_k), "CHUNK": CHUNK}
    return off._compile(kl.kl_stats_kernel, signature, consts, cfg, arch)


def compile_dz(cfg: TileConfig, *, arch: int, reverse: bool, fuse_k: bool) -> Any:
    """``kl_dz_kernel`` as the launcher builds it for bf16 heads of equal H."""
    rows = ("temp_s_ptr", "temp_t_ptr", "lse_s_ptr", "lse_t_ptr", "kl_ptr", "coef_ptr")
    signature = {
        **_descriptors(cfg), "dz": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_n}]>",
        **dict.fromkeys(rows, "*fp32"), "N": "i32", "Vb": "i32", "HS": "i32", "HT": "i32",
        **dict.fromkeys(_STRIDES, "i32"), "stride_dzm": "i32", **dict.fromkeys(_SCALARS, "fp32"),
    }  # fmt: skip
    return off._compile(kl.kl_dz_kernel, signature, _consts(cfg, reverse, fuse_k), cfg, arch)


def candidates() -> dict[str, tuple[TileConfig, bool]]:
    """name -> (tile, fuse_k): the shipped KL tile and the sweep's main alternatives."""
    shipped = kl_tile(settings_for(torch.bfloat16).forward)
    return {
        "shipped": (shipped, False),
        "fuse_k": (shipped, True),
        "fuse_k,stages=2": (replace(shipped, num_stages=2), True),
        "fuse_k,block_k=32,stages=4": (replace(shipped, block_k=32, num_stages=4), True),
        "stages=4": (replace(shipped, num_stages=4), False),
        "block_n=256": (replace(shipped, block_n=256), False),
    }


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    args.add_argument("--only", default="", help="comma-separated candidate names")
    args.add_argument("--json", default="", help="write the table here too")
    opts = args.parse_args()
    only = {x for x in opts.only.split(",") if x}
    rows = []
    for name, (cfg, fuse_k) in candidates().items():
        if only and name not in only:
            continue
        for which, build in (("stats", compile_stats), ("dz", compile_dz)):
            for reverse in (False, True):
                res = off.resources(build(cfg, arch=opts.arch, reverse=reverse, fuse_k=fuse_k))
                label = f"{name} {which} {'reverse' if reverse else 'forward'}"
                rows.append({"name": name, "kernel": which, "reverse": reverse, "fuse_k": fuse_k,
                             "config": asdict(cfg), **asdict(res)})  # fmt: skip
                print(off.line(label, res, 40), flush=True)
    if opts.json:
        off.write_json(opts.json, opts.arch, rows)


if __name__ == "__main__":
    main()
