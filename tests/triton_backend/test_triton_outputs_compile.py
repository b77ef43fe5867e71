"""The outputs' kernel variants compile for an H100/H200 (sm_90a) without a GPU: the interpreter
runs Python, not the compiler, so a construct only the compiler refuses (or a spill) shows here
first. Run as a script it prints each variant's registers, stack and shared memory (triton 3.9:
forward plain 255 regs / 248 B stack, gather 80 B, all extras 184 B; dz plain 170 regs / 0 B,
gather 255 / 0 B):

    python tests/triton_backend/test_triton_outputs_compile.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "plugins" / "triton_backend" / "tools"


def _variants() -> dict[str, dict[str, Any]]:
    """name -> resources of each compiled variant (in a process that compiles, never interprets)."""
    sys.path.insert(0, str(TOOLS))
    import offline_resources as off  # the tool pops TRITON_INTERPRET first
    import torch

    from fusedhead_triton.kernels import dz, forward, sparse

    cfg = __import__("fusedhead_triton.configs", fromlist=["settings_for"]).settings_for(
        torch.bfloat16
    )
    fcfg = cfg.forward
    out: dict[str, dict[str, Any]] = {}
    fwd_sig = {
        "h": f"tensordesc<bf16[{fcfg.block_m}, {fcfg.block_k}]>",
        "w": f"tensordesc<bf16[{fcfg.block_n}, {fcfg.block_k}]>",
        "labels_ptr": "*i64", "temp_ptr": "*fp32", "ws_ptr": "*fp32", "zy_ptr": "*fp32",
        "q_ptr": "*fp32", "arg_ptr": "*i32", "starts_ptr": "*i32", "sids_ptr": "*i32",
        "zg_ptr": "*fp32", "N": "i32", "V": "i32", "H": "i32", "K_g": "i32",
        **dict.fromkeys(("stride_hn", "stride_hk", "stride_wv", "stride_wk"), "i32"),
        "label_offset": "i32", "inv_temp": "fp32", "softcap": "fp32", "inv_softcap": "fp32",
    }  # fmt: skip
    for name, (q, arg, gather) in {
        "fwd_plain": (False, False, False),
        "fwd_sum_p2": (True, False, False),
        "fwd_argmax": (False, True, False),
        "fwd_gather": (False, False, True),
        "fwd_all": (True, True, True),
    }.items():
        consts = {**off._tiles(fcfg), "TMA": True, "EVEN_K": True, "PER_TOKEN_T": False, "HAS_SOFTCAP": False, "HAS_Q": q,
                  "HAS_ARG": arg, "HAS_GATHER": gather}  # fmt: skip
        compiled = off._compile(forward.fwd_stats_kernel, dict(fwd_sig), consts, fcfg, 90)
        out[name] = off.resources(compiled).__dict__
    dcfg = cfg.dz
    dz_sig = {
        "h": f"tensordesc<bf16[{dcfg.block_m}, {dcfg.block_k}]>",
        "w": f"tensordesc<bf16[{dcfg.block_n}, {dcfg.block_k}]>",
        "dz": f"tensordesc<bf16[{dcfg.block_m}, {dcfg.block_n}]>",
        "labels_ptr": "*i64", "temp_ptr": "*fp32", "norm_ptr": "*fp32", "lp_ptr": "*fp32",
        "ent_ptr": "*fp32", "glp_ptr": "*fp32", "gent_ptr": "*fp32", "ax_ptr": "*fp32", "c_ptr": "*fp32",
        "starts_ptr": "*i32", "sids_ptr": "*i32", "gs_ptr": "*fp32", "N": "i32", "Vb": "i32",
        "H": "i32", **dict.fromkeys(
            ("stride_hn", "stride_hk", "stride_wv", "stride_wk", "stride_dzm"), "i32"
        ),
        "label_offset": "i32", "ignore_index": "i32", "inv_temp": "fp32",
        "softcap": "fp32", "inv_softcap": "fp32", "K_sp": "i32", "col0": "i32",
    }  # fmt: skip
    for name, (glp, ax, c, sp, cap) in {
        "dz_plain": (True, False, False, False, False),
        "dz_gather": (True, True, False, True, False),
        "dz_all": (True, True, True, True, True),
    }.items():
        consts = {**off._tiles(dcfg), "TMA": True, "EVEN_K": True, "PER_TOKEN_T": False,
                  "HAS_SOFTCAP": cap, "HAS_GLP": glp,
                  "HAS_GENT": True, "HAS_AX": ax, "HAS_C": c, "HAS_SPARSE": sp}  # fmt: skip
        compiled = off._compile(dz.dz_kernel, dict(dz_sig), consts, dcfg, 90)
        out[name] = off.resources(compiled).__dict__
    comb_sig = {
        "ws_ptr": "*fp32", "q_ptr": "*fp32", "arg_ptr": "*i32", "gm_ptr": "*fp32",
        "m_out_ptr": "*fp32", "sums_ptr": "*i64", "arg_out_ptr": "*i64", "N": "i32", "T": "i32",
        "label_offset": "i32", "arg_width": "i32", "two_f": "fp32",
    }  # fmt: skip
    small = off.TileConfig(64, 64, 64, num_warps=4, num_stages=1)
    for gm in (False, True):  # one process; a rank of a vocab-parallel call (every rank's max)
        consts = {"BLOCK_R": 64, "BLOCK_T": 64, "HAS_GM": gm, "HAS_Q": True, "HAS_ARG": True}
        compiled = off._compile(forward.combine_kernel, dict(comb_sig), consts, small, 90)
        out[f"combine_{'shard' if gm else 'one'}"] = off.resources(compiled).__dict__
    fin_sig = {
        "m_ptr": "*fp32", "sums_ptr": "*i64", "zy_ptr": "*fp32", "labels_ptr": "*i64",
        "lp_ptr": "*fp32", "lse_ptr": "*fp32", "logs_ptr": "*fp32", "ent_ptr": "*fp32",
        "p2_ptr": "*fp32", "N": "i32",
        "ignore_index": "i32", "inv_two_f": "fp32",
    }  # fmt: skip
    consts = {"BLOCK_R": 64, "HAS_ENT": True, "HAS_Q": True}
    compiled = off._compile(forward.finish_kernel, fin_sig, consts, small, 90)
    out["finish"] = off.resources(compiled).__dict__
    starts_sig = {"sids_ptr": "*i32", "out_ptr": "*i32", "N": "i32", "K": "i32", "T1": "i32",
                  "origin": "i32", "width": "i32"}  # fmt: skip
    consts = {"BLOCK_R": 64, "BLOCK_T": 16, "STEPS": 9}
    compiled = off._compile(sparse.tile_starts_kernel, starts_sig, consts, small, 90)
    out["tile_starts"] = off.resources(compiled).__dict__
    return out


@pytest.mark.slow
def test_the_outputs_kernels_compile_for_sm90_without_spills() -> None:
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this triton install has no cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, __file__, "--json"], capture_output=True, text=True, env=env,
        timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 12
    for name, r in rows.items():
        assert r["shared_bytes"] <= 228 * 1024, f"{name}: {r}"
    # The timed cases spill no more than the plain forward (which holds a 128 x 256 fp32 tile at
    # 255 registers already): gather extracts its ids before the softmax temporaries exist.
    assert rows["fwd_gather"]["stack_bytes"] <= rows["fwd_plain"]["stack_bytes"], rows
    assert rows["dz_gather"]["stack_bytes"] <= rows["dz_plain"]["stack_bytes"], rows
    assert rows["tile_starts"]["stack_bytes"] == 0, rows


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    result = _variants()
    if "--json" in sys.argv:
        print(json.dumps(result))
    else:
        for k, r in result.items():
            print(f"{k:16s} regs {r['registers']:4d}  stack {r['stack_bytes']:5d} B  "
                  f"shared {r['shared_bytes'] / 1024:6.1f} KiB")  # fmt: skip
