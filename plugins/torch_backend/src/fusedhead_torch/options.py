"""The torch backend's options and what they decide: the tiles a call walks and whether the
logits GEMMs write fp32. The backend and its KL and extra-outputs paths take the options (not the
backend), so none of those modules imports another's.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from fusedhead_torch.tiling import Tiles, plan_forward_tiles, plan_tiles

#: Default workspace for the logit tiles, per device type, in MiB. CUDA: 12 vocabulary blocks at
#: N=8192, V=151936 in bf16 (wider blocks gain little, see tools/gpu_tune.py). CPU: small enough
#: that each GEMM output stays under glibc's 32 MiB mmap ceiling, whose freed heap the process
#: otherwise keeps resident (peak extra ~170 MiB at N=2048, V=32000, H=1024 fp32: 14% of full
#: logits); larger budgets were at most ~10% faster there.
DEFAULT_WORKSPACE_MIB = {"cuda": 1024, "cpu": 32}
#: bf16/fp16 logits GEMMs write fp32 unless ``fp32_logits=False`` (measured: plugin README).
DEFAULT_FP32_LOGITS = True


class TorchOptions(BaseModel):
    """Tiling of the ``[N, V]`` logits. Explicit sizes win; the workspace budget fills in the rest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workspace_mib: PositiveInt | None = Field(
        default=None,
        description="Bound on the fp32/input-dtype buffers of one logit tile, in MiB "
        "(default: 1024 on CUDA, 32 on the CPU).",
    )
    block_vocab: PositiveInt | None = Field(
        default=None,
        description="Vocabulary columns per block of the backward (default: from the workspace, "
        "whole 1024-column tiles); the forward walks the fixed 1024-column grid "
        "(docs/vocab-parallel.md) with the rows a block of this width fits, and the backward "
        "recomputes each block's logits with the forward's GEMMs, so a width off that grid "
        "recomputes the grid tiles it cuts whole.",
    )
    chunk_rows: PositiveInt | None = Field(
        default=None,
        description="Rows per chunk (default: all rows, unless a block would get too narrow).",
    )
    skip_ignored_rows: bool | None = Field(
        default=None,
        description="Leave rows whose label is ignore_index out of every GEMM (they give 0 "
        "anyway). Finding them costs a device-to-host sync, so the default is on for the CPU "
        "and off for CUDA (CUDA graphs); under torch.compile they are always masked instead.",
    )
    fp32_logits: bool | None = Field(
        default=None,
        description="bf16/fp16 inputs: the logits GEMMs accumulate and write fp32 (torch.mm "
        "with out_dtype=float32 on CUDA, upcast operands elsewhere) instead of rounding the "
        "logits to the input dtype. Default: on (see the plugin README for time and memory).",
    )
    compile_elementwise: bool | None = Field(
        default=None,
        description="Fuse the per-tile elementwise work through torch.compile (no softcap): "
        "the head's backward dz in one pass instead of about eight, the policy loss's chunk in "
        "two instead of about ten; the head's forward statistics stay eager (their bits do not "
        "depend on the batch). Default: on for CUDA, off elsewhere (the first call compiles, "
        "some seconds).",
    )


def bytes_per_element(dtype: torch.dtype, softcap: float | None) -> int:
    """Workspace bytes per tile element: the GEMM output plus the fp32 buffers of the worse pass."""
    fp32 = dtype == torch.float32
    base = 8 if fp32 else 2 + 8  # fp32 tiles are worked in place; others add two fp32 buffers
    return base + (8 if softcap is not None else 0)  # a softcap's tanh and its derivative


def workspace_bytes(options: TorchOptions, device: torch.device) -> int:
    """The workspace budget of one logit tile on ``device``, in bytes."""
    mib = options.workspace_mib or DEFAULT_WORKSPACE_MIB.get(
        device.type, DEFAULT_WORKSPACE_MIB["cpu"]
    )
    return mib << 20


def fp32_logits(options: TorchOptions, device: torch.device) -> bool:
    """Whether bf16/fp16 logits are accumulated and written in fp32 on ``device``."""
    opt = options.fp32_logits
    return DEFAULT_FP32_LOGITS if opt is None else opt


def backward_tiles(
    options: TorchOptions,
    n: int,
    v: int,
    dtype: torch.dtype,
    device: torch.device,
    softcap: float | None = None,
) -> Tiles:
    """The tiles a call with ``n`` rows and ``v`` local vocabulary columns walks (the backward's)."""
    return plan_tiles(
        n,
        v,
        bytes_per_element=bytes_per_element(dtype, softcap),
        budget_bytes=workspace_bytes(options, device),
        chunk_rows=options.chunk_rows,
        block_vocab=options.block_vocab,
    )


def forward_tiles(
    options: TorchOptions,
    n: int,
    v: int,
    dtype: torch.dtype,
    device: torch.device,
    softcap: float | None = None,
) -> Tiles:
    """The forward's tiles: ``GRID_COLS`` columns each (the vocabulary grid), rows as budgeted."""
    return plan_forward_tiles(
        n,
        v,
        bytes_per_element=bytes_per_element(dtype, softcap),
        budget_bytes=workspace_bytes(options, device),
        chunk_rows=options.chunk_rows,
        block_vocab=options.block_vocab,
    )
