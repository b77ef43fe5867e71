"""``TorchBackend``: the portable backend, plain PyTorch ops on the CPU or CUDA, memory-bounded."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import BaseModel

from fusedhead.errors import BackendUnavailableError
from fusedhead.grad_sum import addmm_out_dtype_works
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
from fusedhead_torch.fused_passes import compile_by_default
from fusedhead_torch.kl import KL_DIRECTIONS, forward_kl
from fusedhead_torch.options import (
    TorchOptions,
    backward_tiles,
    forward_tiles,
    fp32_logits,
    workspace_bytes,
)
from fusedhead_torch.outputs import (
    EXTRA_OUTPUTS,
    MAX_TOP_K,
    VOCAB_PARALLEL_OUTPUTS,
    forward_outputs,
)
from fusedhead_torch.policy import chunk_rows, policy_loss
from fusedhead_torch.rowstats import MAX_GRID_VOCAB
from fusedhead_torch.tile_math import (
    MAX_SCALE,
    inverse_temperature,
    mm_out_dtype_works,
)
from fusedhead_torch.tiling import GRID_COLS, Tiles, skips_rows

SUPPORTED_DEVICES = ("cpu", "cuda")
SUPPORTED_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_BASIC_OUTPUTS = frozenset({"log_probs", "entropy"})


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
            # 1/T is held at MAX_SCALE (2^100): below 1/MAX_SCALE the log-probs would saturate
            # at -2^100 times the logit gap, not -1/T times it, so those temperatures are refused.
            min_temperature=1.0 / MAX_SCALE,
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
        return fp32_logits(self.options, device)

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
        if dtype != torch.float32:  # the trial GEMMs now, eagerly: a compiled call only reads them
            mm_out_dtype_works(device, dtype)
            addmm_out_dtype_works(device, dtype)

    def tiles(
        self, n: int, v: int, dtype: torch.dtype, device: torch.device, softcap: float | None = None
    ) -> Tiles:
        """The tiles a call with ``n`` rows and ``v`` local vocabulary columns walks."""
        return backward_tiles(self.options, n, v, dtype, device, softcap)

    def forward_tiles(
        self, n: int, v: int, dtype: torch.dtype, device: torch.device, softcap: float | None = None
    ) -> Tiles:
        """The forward's tiles: ``GRID_COLS`` columns each (the vocabulary grid), rows as budgeted."""
        return forward_tiles(self.options, n, v, dtype, device, softcap)

    def forward(self, call: HeadCall) -> HeadOutput:
        """fp32 ``log_probs [N]`` and ``entropy [N]`` (or None), differentiable in hidden/weight."""
        if call.vocab_size >= MAX_GRID_VOCAB:
            raise ValueError(
                f"vocab_size: the torch backend's exact (fixed-point) combine of the vocabulary "
                f"tiles takes vocabularies below {MAX_GRID_VOCAB} columns, got {call.vocab_size}"
            )
        if not call.outputs <= _BASIC_OUTPUTS:  # top-k, gather, lse, sum_p2, argmax: outputs.py
            return forward_outputs(self.options, call)
        hidden, weight, labels = call.hidden, call.weight, call.labels
        temperature, ignore_index, softcap = call.temperature, call.ignore_index, call.softcap
        return_entropy = call.return_entropy
        n = hidden.shape[0]
        scored = labels != ignore_index
        # Not differentiable: the temperature is a sampling setting, not a parameter.
        inv_t = inverse_temperature(temperature, scored)
        keep = (
            scored.nonzero().squeeze(1)
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
            compile_dz=compile_by_default(self.options.compile_elementwise, hidden.device),
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
        return forward_kl(self.options, call)

    def policy_loss(self, call: PolicyLossCall) -> PolicyLossResult:
        """The policy loss's statistics and gradients in three matmuls per row chunk."""
        head = call.head
        device = head.hidden.device
        use_compile = compile_by_default(self.options.compile_elementwise, device)
        rows = chunk_rows(
            head.weight.shape[0],
            head.hidden.dtype,
            workspace_bytes(self.options, device),
            head.softcap is not None,
            self.options.chunk_rows,
            compiled_chunk=use_compile,
        )
        return policy_loss(call, rows, self.fp32_logits(device), use_compile)
