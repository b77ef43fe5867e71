"""Registers, stack and shared memory of the KL kernels, compiled for a GPU without one.

Usage (any machine with triton's NVIDIA backend, no GPU needed):
    python plugins/triton_backend/tools/kl_offline.py [--arch 90] [--only NAMES] [--json OUT]

Compiles ``kl_stats_kernel`` and ``kl_dz_kernel`` (bf16, TMA, both directions) for ``sm_<arch>a``
with the shipped KL tile and the sweep's alternatives (tools/kl_sweep.py), and reads the
resource usage as tools/offline_resources.py does: a non-zero stack means spilled registers, the
shared memory must fit one program per SM (228 KiB on an H100/H200). Both heads' fp32
accumulators are live at once, which is what bounds the KL tile. Pointer arguments and the
specialised integers (H, strides) carry the 16-byte divisibility the JIT gives them at launch, so
the numbers are the launched kernel's.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offline_resources as off
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusedhead_triton.configs import TileConfig, settings_for
from fusedhead_triton.kernels import kl
from fusedhead_triton.kl import CHUNK, kl_tile

_HEADS = ("hs", "ws", "ht", "wt")
_STRIDES = tuple(f"stride_{x}" for x in ("hsn", "hsk", "wsv", "wsk", "htn", "htk", "wtv", "wtk"))
_SCALARS = ("inv_temp_s", "inv_temp_t", "softcap_s", "inv_softcap_s", "softcap_t", "inv_softcap_t")
_ROWS = ("temp_s_ptr", "temp_t_ptr", "norm_ptr", "coef_ptr")


@dataclass(frozen=True)
class Candidate:
    """One compiled variant: the tile and its knobs."""

    cfg: TileConfig
    softcap: bool = False


#: Integer arguments the JIT does not specialise (``do_not_specialize``): no divisibility.
_UNSPECIALISED = ("N", "V", "Vb")


def _compile(kernel: Any, signature: dict[str, str], consts: dict[str, Any], cfg: TileConfig,
             arch: int) -> Any:  # fmt: skip
    """``kernel`` for ``sm_<arch>a`` with the launch's divisibility: every pointer and every
    specialised integer (here 4096-sized H and strides) a multiple of 16."""
    names = list(kernel.arg_names)
    attrs = {
        (names.index(k),): [["tt.divisibility", 16]]
        for k, ty in signature.items()
        if ty.startswith("*") or (ty == "i32" and k not in _UNSPECIALISED)
    }
    signature = {**signature, **{k: "constexpr" for k in consts}}
    src = ASTSource(
        fn=kernel, signature=signature, attrs=attrs,
        constexprs={(names.index(k),): v for k, v in consts.items()},
    )  # fmt: skip
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _descriptors(cfg: TileConfig) -> dict[str, str]:
    a = f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>"
    b = f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>"
    return dict(zip(_HEADS, (a, b, a, b)))


def _consts(c: Candidate, reverse: bool) -> dict[str, Any]:
    cfg = c.cfg
    return dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_PROGS=132, TMA=True, EVEN_KS=True, EVEN_KT=True, PRECISION="tf32",
        PER_TOKEN_TS=False, PER_TOKEN_TT=False, SOFTCAP_S=c.softcap, SOFTCAP_T=c.softcap,
        REVERSE=reverse,
    )  # fmt: skip


def compile_stats(c: Candidate, *, arch: int, reverse: bool) -> Any:
    """``kl_stats_kernel`` of ``c`` as the launcher builds it for bf16 heads of equal H."""
    signature = {
        **_descriptors(c.cfg), "temp_s_ptr": "*fp32", "temp_t_ptr": "*fp32", "out_ptr": "*fp32",
        "N": "i32", "V": "i32", "HS": "i32", "HT": "i32", **dict.fromkeys(_STRIDES, "i32"),
        **dict.fromkeys(_SCALARS, "fp32"),
    }  # fmt: skip
    consts = {**_consts(c, reverse), "CHUNK": CHUNK}
    return _compile(kl.kl_stats_kernel, signature, consts, c.cfg, arch)


def compile_dz(c: Candidate, *, arch: int, reverse: bool) -> Any:
    """``kl_dz_kernel`` of ``c`` as the launcher builds it for bf16 heads of equal H."""
    cfg = c.cfg
    signature = {
        **_descriptors(cfg), "dz": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_n}]>",
        **dict.fromkeys(_ROWS, "*fp32"), "N": "i32", "Vb": "i32", "HS": "i32", "HT": "i32",
        **dict.fromkeys(_STRIDES, "i32"), "stride_dzm": "i32", **dict.fromkeys(_SCALARS, "fp32"),
    }  # fmt: skip
    return _compile(kl.kl_dz_kernel, signature, _consts(c, reverse), cfg, arch)


def candidates() -> dict[str, Candidate]:
    """name -> candidate: the shipped KL tile and the sweep's main alternatives."""
    shipped = kl_tile(settings_for(torch.bfloat16).forward)
    return {
        "shipped": Candidate(shipped),
        "stages=3": Candidate(replace(shipped, num_stages=3)),
        "stages=5": Candidate(replace(shipped, num_stages=5)),
        "stages=6": Candidate(replace(shipped, num_stages=6)),
        "block_k=32,stages=8": Candidate(replace(shipped, block_k=32, num_stages=8)),
        "block_n=256": Candidate(replace(shipped, block_n=256)),
        "softcap": Candidate(shipped, softcap=True),
    }


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    args.add_argument("--only", default="", help="comma-separated candidate names")
    args.add_argument("--json", default="", help="write the table here too")
    opts = args.parse_args()
    only = {x for x in opts.only.split(",") if x}
    rows: list[dict[str, Any]] = []
    for name, c in candidates().items():
        if only and name not in only:
            continue
        for which, build in (("stats", compile_stats), ("dz", compile_dz)):
            for reverse in (False, True):
                label = f"{name} {which} {'reverse' if reverse else 'forward'}"
                try:
                    res = off.resources(build(c, arch=opts.arch, reverse=reverse))
                except Exception as exc:  # e.g. shared memory past the SM's: say so, go on
                    print(f"{label:44s} failed: {type(exc).__name__}: {str(exc)[:200]}")
                    rows.append({"name": name, "kernel": which, "reverse": reverse,
                                 "error": f"{type(exc).__name__}: {str(exc)[:300]}"})  # fmt: skip
                    continue
                rows.append({"name": name, "kernel": which, "reverse": reverse,
                             "softcap": c.softcap, "config": asdict(c.cfg),
                             **asdict(res)})  # fmt: skip
                print(off.line(label, res, 44), flush=True)
    if opts.json:
        off.write_json(opts.json, opts.arch, rows)


if __name__ == "__main__":
    main()
