"""``TorchBackend``: the portable backend, plain PyTorch ops on the CPU or CUDA, memory-bounded."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from fusedhead.errors import BackendUnavailableError
from fusedhead.protocol import (
    Capabilities,
    HeadCall,
    HeadOutput,
    KLCall,
    KLOutput,
    PolicyLossCall,
    PolicyLossResult,
)
from fusedhead_torch.chunked import ChunkedFusedHead, HeadSpec
from fusedhead_torch.kl import KL_DIRECTIONS, forward_kl
from fusedhead_torch.outputs import (
    EXTRA_OUTPUTS,
    MAX_TOP_K,
    VOCAB_PARALLEL_OUTPUTS,
    forward_outputs,
)
from fusedhead_torch.policy import chunk_rows, policy_loss
from fusedhead_torch.rowstats import MAX_GRID_VOCAB
from fusedhead_torch.tile_math import _mm_out_dtype_works
from fusedhead_torch.tiling import GRID_COLS, Tiles, plan_forward_tiles, plan_tiles, skips_rows

#: Default workspace for the logit tiles, per device type, in MiB. CUDA: 12 vocabulary blocks at
#: N=8192, V=151936 in bf16 (wider blocks gain little, see tools/gpu_tune.py). CPU: small enough
#: that each GEMM output stays under glibc's 32 MiB mmap ceiling, whose freed heap the process
#: otherwise keeps resident (peak extra ~170 MiB at N=2048, V=32000, H=1024 fp32: 14% of full
#: logits); larger budgets were at most ~10% faster there.
DEFAULT_WORKSPACE_MIB = {"cuda": 1024, "cpu": 32}
#: bf16/fp16 logits GEMMs write fp32 unless ``fp32_logits=False`` (measured: plugin README).
DEFAULT_FP32_LOGITS = True
SUPPORTED_DEVICES = ("cpu", "cuda")
SUPPORTED_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_BASIC_OUTPUTS = frozenset({"log_probs", "entropy"})


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
        description="Vocabulary columns per block of the backward (default: from the workspace); "
        "the forward walks the fixed 1024-column grid (docs/vocab-parallel.md).",
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
    compile_policy: bool | None = Field(
        default=None,
        description="The policy loss's per-chunk elementwise work through torch.compile (two "
        "fused passes instead of about ten; no softcap). Default: on for CUDA, off elsewhere "
        "(the first call compiles, some seconds).",
    )


def _bytes_per_element(dtype: torch.dtype, softcap: float | None) -> int:
    """Workspace bytes per tile element: the GEMM output plus the fp32 buffers of the worse pass."""
    fp32 = dtype == torch.float32
    base = 8 if fp32 else 2 + 8  # fp32 tiles are worked in place; others add two fp32 buffers
    return base + (8 if softcap is not None else 0)  # a softcap's tanh and its derivative


class TorchBackend:
    """Chunked PyTorch implementation: per-row statistics forward, recomputing blocked backward."""

    name: ClassVar[str] = "torch"
    Options: ClassVar[type[BaseModel]] = TorchOptions
    plugin_api_version: ClassVar[int] = 2

    def __init__(self, options: TorchOptions | None = None) -> None:
        self.options = options if options is not None else TorchOptions()

    def capabilities(self, device: torch.device) -> Capabilities:
        """What it does on ``device`` (the same on the CPU and CUDA)."""
        return Capabilities(
            devices=SUPPORTED_DEVICES,
            dtypes=("fp32", "fp16", "bf16"),
            vocab_parallel=True,
            deterministic=True,
            batch_invariant=False,
            entropy_precision="fp32",
            # fp32_logits: the GEMMs write fp32; otherwise logits in the input dtype, then fp32.
            logits_precision="fp32" if self.fp32_logits(device) else "bf16",
            per_token_temperature=True,
            softcap=True,
            uneven_shards=True,
            degree_invariant=True,
            vocab_grid=GRID_COLS,
            outputs=("log_probs", "entropy", *EXTRA_OUTPUTS),
            max_top_k=MAX_TOP_K,
            vocab_parallel_outputs=VOCAB_PARALLEL_OUTPUTS,
            kl_directions=KL_DIRECTIONS,
            policy_loss=True,
        )

    def fp32_logits(self, device: torch.device) -> bool:
        """Whether bf16/fp16 logits are accumulated and written in fp32 on ``device``."""
        opt = self.options.fp32_logits
        return DEFAULT_FP32_LOGITS if opt is None else opt

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise ``BackendUnavailableError`` if ``device``/``dtype`` cannot run here."""
        device = torch.device(device)
        if device.type not in SUPPORTED_DEVICES:
            raise BackendUnavailableError(
                f"backend 'torch' runs on {', '.join(SUPPORTED_DEVICES)}, not on "
                f"'{device.type}'; move hidden and weight to the CPU or a CUDA device"
            )
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError(
                "backend 'torch' was asked for CUDA but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); install a CUDA build of torch or use device 'cpu'"
            )
        if dtype not in SUPPORTED_DTYPES:
            raise BackendUnavailableError(
                f"backend 'torch' computes fp32, fp16 and bf16 inputs, not {dtype}; cast "
                "hidden and weight to one of those"
            )
        if dtype != torch.float32:  # its trial GEMM now, eagerly: a compiled call only reads it
            _mm_out_dtype_works(device, dtype)

    def tiles(
        self, n: int, v: int, dtype: torch.dtype, device: torch.device, softcap: float | None = None
    ) -> Tiles:
        """The tiles a call with ``n`` rows and ``v`` local vocabulary columns walks."""
        opts = self.options
        mib = opts.workspace_mib or DEFAULT_WORKSPACE_MIB.get(
            device.type, DEFAULT_WORKSPACE_MIB["cpu"]
        )
        return plan_tiles(
            n,
            v,
            bytes_per_element=_bytes_per_element(dtype, softcap),
            budget_bytes=mib << 20,
            chunk_rows=opts.chunk_rows,
            block_vocab=opts.block_vocab,
        )

    def forward_tiles(
        self, n: int, v: int, dtype: torch.dtype, device: torch.device, softcap: float | None = None
    ) -> Tiles:
        """The forward's tiles: ``GRID_COLS`` columns each (the vocabulary grid), rows as budgeted."""
        mib = self.options.workspace_mib or DEFAULT_WORKSPACE_MIB.get(
            device.type, DEFAULT_WORKSPACE_MIB["cpu"]
        )
        return plan_forward_tiles(
            n,
            v,
            bytes_per_element=_bytes_per_element(dtype, softcap),
            budget_bytes=mib << 20,
            chunk_rows=self.options.chunk_rows,
        )

    def forward(self, call: HeadCall) -> HeadOutput:
        """fp32 ``log_probs [N]`` and ``entropy [N]`` (or None), differentiable in hidden/weight."""
        if call.vocab_size >= MAX_GRID_VOCAB:
            raise ValueError(
                f"vocab_size: the torch backend's exact (fixed-point) combine of the vocabulary "
                f"tiles takes vocabularies below {MAX_GRID_VOCAB} columns, got {call.vocab_size}"
            )
        if not call.outputs <= _BASIC_OUTPUTS:  # top-k, gather, lse, sum_p2, argmax: outputs.py
            return forward_outputs(self, call)
        hidden, weight, labels = call.hidden, call.weight, call.labels
        temperature, ignore_index, softcap = call.temperature, call.ignore_index, call.softcap
        return_entropy = call.return_entropy
        n = hidden.shape[0]
        if isinstance(temperature, torch.Tensor):
            # Not differentiable: the temperature is a sampling setting, not a parameter.
            temp = temperature.detach().to(device=hidden.device, dtype=torch.float32)
            inv_t: float | torch.Tensor = temp.expand(n).reciprocal()
        else:
            inv_t = 1.0 / float(temperature)
        keep = (
            (labels != ignore_index).nonzero().squeeze(1)
            if skips_rows(self.options.skip_ignored_rows, hidden)
            else None
        )
        if keep is not None and keep.numel() < n:
            # Scored rows only; index_select/index_copy carry the gradients back (0 elsewhere).
            hidden = hidden.index_select(0, keep)
            labels = labels.index_select(0, keep)
            if isinstance(inv_t, torch.Tensor):
                inv_t = inv_t.index_select(0, keep)
        else:
            keep = None
        spec = HeadSpec(
            ignore_index=int(ignore_index),
            return_entropy=bool(return_entropy),
            softcap=None if softcap is None else float(softcap),
            tiles=self.tiles(
                hidden.shape[0], weight.shape[0], hidden.dtype, hidden.device, softcap
            ),
            vocab_start=call.vocab_start,
            vocab_size=call.vocab_size,
            process_group=call.process_group,
            reduce_hidden_grad=call.reduce_hidden_grad,
            fp32_logits=self.fp32_logits(hidden.device),
            forward_tiles=self.forward_tiles(
                hidden.shape[0], weight.shape[0], hidden.dtype, hidden.device, softcap
            ),
        )
        out = ChunkedFusedHead.apply(hidden, weight, labels, inv_t, spec)  # type: ignore[no-untyped-call]
        log_probs, entropy = out if return_entropy else (out, None)
        if keep is not None:
            log_probs = log_probs.new_zeros(n).index_copy(0, keep, log_probs)
            if entropy is not None:
                entropy = entropy.new_zeros(n).index_copy(0, keep, entropy)
        return HeadOutput(log_probs, entropy)

    def kl(self, call: KLCall) -> KLOutput:
        """Per-token KL between the student and the teacher head (fusedhead_torch.kl)."""
        return forward_kl(self, call)

    def policy_loss(self, call: PolicyLossCall) -> PolicyLossResult:
        """The policy loss's statistics and gradients in three matmuls per row chunk."""
        head = call.head
        device = head.hidden.device
        mib = self.options.workspace_mib or DEFAULT_WORKSPACE_MIB.get(
            device.type, DEFAULT_WORKSPACE_MIB["cpu"]
        )
        rows = chunk_rows(
            head.weight.shape[0],
            head.hidden.dtype,
            mib << 20,
            head.softcap is not None,
            self.options.chunk_rows,
        )
        use_compile = self.options.compile_policy
        if use_compile is None:
            use_compile = device.type == "cuda"
        return policy_loss(call, rows, self.fp32_logits(device), use_compile)
