"""The ``triton`` backend class: options, capabilities, availability check, and the call."""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from fusedhead.errors import BackendUnavailableError
from fusedhead.protocol import Capabilities, HeadCall, HeadOutput

from .configs import default_configs, interpret_enabled, with_overrides

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class TritonOptions(BaseModel):
    """Tuning knobs. None of them may depend on the batch: the forward stays batch invariant."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_m: int | None = Field(
        None,
        description="Rows per tile (power of two >= 16); None keeps the shipped per-dtype config.",
    )
    block_n: int | None = Field(
        None, description="Vocabulary columns per tile (power of two >= 16)."
    )
    block_k: int | None = Field(
        None, description="Hidden (reduction) step per tile iteration (power of two >= 16)."
    )
    tma: bool | None = Field(
        None,
        description="Persistent grid with TMA loads for the logits GEMMs (Hopper+); None: shipped default.",
    )
    backward_block_mib: float | None = Field(
        default=None,
        gt=0,
        description="Bound on the backward's dz[N, Vb] block buffer, in MiB (sets Vb from N). Wider blocks "
        "are faster (fewer launches, less hidden-gradient traffic) and cost memory. None: 64 MiB when dz blocks "
        "can also live in the weight gradient's unwritten rows and the sum is stashed (lend_dw_rows and "
        "stash_dh_sum, both gradients asked), else 256 MiB.",
    )
    backward_block_max_cols: int = Field(
        default=8192,
        ge=16,
        description="Upper bound on Vb, the vocabulary columns per backward block.",
    )
    dh_gemm: Literal["auto", "triton", "cublas"] = Field(
        "auto",
        description="GEMM that adds dz @ W_block into the hidden-gradient sum: this package's Triton kernel "
        "(its running sum split in two parts, see dh_sum: less memory), or cuBLAS with an fp32 accumulator "
        "where torch offers addmm(out_dtype=float32) (falls back to Triton otherwise); auto: Triton for bf16, "
        "and for fp16 cuBLAS while its accumulator (N x H fp32) is at most 256 MiB, else Triton.",
    )
    stash_dh_sum: bool = Field(
        True,
        description="Keep the hidden-gradient running sum's own part (fp24: N x H bytes; fp32 or pair: "
        "N x H x 2; cuBLAS: N x H x 4) in the weight gradient's last rows until the sum is final, then "
        "recompute those rows' logits to write them: saves that memory for about N/(2V) (N/V, 2N/V) more "
        "GEMM units. Applies when both gradients are asked and dW has the rows.",
    )
    dh_sum: Literal["auto", "fp32", "fp24", "pair"] = Field(
        "auto",
        description="How the Triton dh GEMM keeps its running sum between vocabulary blocks, the high 16 bits "
        "in the output's own buffer: 'fp32' exact fp32 (2 more bytes per value), 'fp24' fp32 rounded to a "
        "16-bit significand (1 more byte: halves what stash_dh_sum recomputes), 'pair' a bf16 value plus a "
        "bf16 remainder (fp16 inputs: a separate fp32 buffer); auto: fp24 when the sum is stashed, else fp32.",
    )
    lend_dw_rows: bool = Field(
        True,
        description="Put each backward dz block in weight-gradient rows not written yet where it fits (early "
        "blocks up to backward_block_max_cols wide at no memory cost), the block buffer elsewhere: fewer "
        "read-modify-writes of the hidden-gradient sum. Applies when the weight gradient is asked.",
    )

    @field_validator("block_m", "block_n", "block_k")
    @classmethod
    def _power_of_two(cls, v: int | None) -> int | None:
        if v is not None and (v < 16 or v & (v - 1)):
            raise ValueError(f"tile sizes must be powers of two >= 16, got {v}")
        return v


class TritonBackend:
    """Fused Triton kernels: fp32 statistics from tiles, fixed-order combine, blockwise backward."""

    name: ClassVar[str] = "triton"
    Options: ClassVar[type[BaseModel]] = TritonOptions
    plugin_api_version: ClassVar[int] = 2

    def __init__(self, options: TritonOptions | None = None) -> None:
        self.options = options if options is not None else TritonOptions()

    def capabilities(self, device: torch.device) -> Capabilities:
        """Batch invariant, deterministic, fp32 statistics; CPU only under the interpreter."""
        device = torch.device(device)
        interp = interpret_enabled()
        devices = ("cuda", "cpu") if interp else ("cuda",)
        dtypes: tuple[Any, ...] = ("fp32", "fp16", "bf16")
        if device.type == "cpu" or interp:
            dtypes = ("fp32", "fp16")  # bf16 tl.dot is wrong under the interpreter
        return Capabilities(
            devices=devices,
            dtypes=dtypes,
            vocab_parallel=True,
            deterministic=True,
            batch_invariant=True,
            entropy_precision="fp32",
            logits_precision="fp32",
            per_token_temperature=True,
            softcap=True,
            uneven_shards=True,
        )

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise BackendUnavailableError with the reason and the fix where the kernels can't run."""
        device = torch.device(device)
        if importlib.util.find_spec("triton") is None:
            raise BackendUnavailableError(
                "the triton backend needs the 'triton' package, which is not installed; "
                "install it with: pip install 'fusedhead[triton]'"
            )
        if dtype not in _DTYPE_NAMES:
            raise BackendUnavailableError(
                f"the triton backend computes in fp32, fp16 or bf16, not {dtype}; "
                "cast hidden and weight to one of those"
            )
        interp = interpret_enabled()
        if device.type == "cuda":
            if interp:
                raise BackendUnavailableError(
                    "TRITON_INTERPRET=1 is set, so Triton would run the kernels on the CPU "
                    "interpreter, not on the GPU; unset TRITON_INTERPRET to use the CUDA device"
                )
            if not torch.cuda.is_available():
                raise BackendUnavailableError(
                    "no CUDA device is available to this process; run on a CUDA GPU "
                    "(compute capability 8.0 or newer) or use backend='torch'"
                )
            index = device.index if device.index is not None else torch.cuda.current_device()
            cap = torch.cuda.get_device_capability(index)
            if cap < (8, 0):
                name = torch.cuda.get_device_name(index)
                raise BackendUnavailableError(
                    f"the triton backend needs a GPU of compute capability 8.0 or newer "
                    f"(Ampere+); {name} is {cap[0]}.{cap[1]}; use backend='torch'"
                )
            return
        if device.type == "cpu":
            if not interp:
                raise BackendUnavailableError(
                    "the triton backend runs on CUDA GPUs and this is the CPU; set "
                    "TRITON_INTERPRET=1 to run the kernels on the CPU for testing, or use "
                    "backend='torch'"
                )
            if dtype == torch.bfloat16:
                raise BackendUnavailableError(
                    "bf16 dot products are wrong under the Triton interpreter "
                    "(TRITON_INTERPRET=1); on the CPU use fp32 or fp16, or backend='torch'"
                )
            return
        raise BackendUnavailableError(
            f"the triton backend runs on CUDA devices, not {device.type!r}; use backend='torch'"
        )

    def forward(self, call: HeadCall) -> HeadOutput:
        """fp32 log_probs [N] and entropy [N] (or None), differentiable in hidden and weight."""
        from .function import CallSpec, FusedHeadFunction
        from .launch import HeadScalars

        hidden, weight, labels = call.hidden, call.weight, call.labels
        temperature, softcap, return_entropy = call.temperature, call.softcap, call.return_entropy

        temp: torch.Tensor | None = None
        inv_temp = 1.0
        if isinstance(temperature, torch.Tensor):
            if temperature.requires_grad and torch.is_grad_enabled():
                raise ValueError(
                    "temperature: the triton backend does not differentiate w.r.t. a "
                    "per-token temperature; pass temperature.detach()"
                )
            temp = temperature.detach().to(device=hidden.device, dtype=torch.float32)
            temp = temp.expand(labels.shape).contiguous()
        else:
            inv_temp = 1.0 / float(temperature)
        o = self.options
        configs = with_overrides(
            default_configs(hidden.dtype),
            block_m=o.block_m,
            block_n=o.block_n,
            block_k=o.block_k,
            tma=o.tma,
        )
        spec = CallSpec(
            scalars=HeadScalars(
                label_offset=call.vocab_start,
                ignore_index=call.ignore_index,
                inv_temp=inv_temp,
                softcap=float(softcap) if softcap is not None else None,
            ),
            return_entropy=bool(return_entropy),
            process_group=call.process_group,
            reduce_hidden_grad=call.reduce_hidden_grad,
            configs=configs,
            backward_block_bytes=(
                None if o.backward_block_mib is None else int(o.backward_block_mib * 2**20)
            ),
            backward_block_max_cols=o.backward_block_max_cols,
            dh_gemm=o.dh_gemm,
            stash_dh_sum=o.stash_dh_sum,
            dh_sum=o.dh_sum,
            lend_dw_rows=o.lend_dw_rows,
        )
        labels = labels.contiguous()
        out = FusedHeadFunction.apply(hidden, weight, labels, temp, spec)
        if return_entropy:
            logp, ent = out
            return HeadOutput(logp, ent)
        return HeadOutput(out)
