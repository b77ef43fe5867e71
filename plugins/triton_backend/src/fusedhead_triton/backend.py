"""The ``triton`` backend class: options, capabilities, availability check, and the call."""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from fusedhead.errors import BackendUnavailableError, OptionsError
from fusedhead.protocol import (
    KL_DIRECTIONS,
    Capabilities,
    HeadCall,
    HeadOutput,
    KLCall,
    KLOutput,
    PolicyLossCall,
    PolicyLossResult,
)

from .configs import (
    GRID_COLS,
    MAX_TOP_K,
    Settings,
    fitting_tile,
    interpret_enabled,
    settings_for,
    shared_memory_excess,
)
from .interpreter_probe import interpreter_problem

#: Smallest temperature computed to the declared precision. The backward forms each logit's
#: ``z / T - lse`` in one fused multiply-add against the rounded ``lse``, so its error is about
#: half an fp32 ulp of ``lse``: by the arithmetic about 1e-3 of a probability at ``|z| / T`` ~ 3e4
#: (logits of 30 at T = 1e-3), growing with 1/T; on an H200 gradients were non-finite from
#: T = 1e-8 (the KL) and 1e-10 (log-probs) with logits of about 5 (docs/benchmarks.md). The torch backend forms
#: ``z - max`` exactly and takes temperatures down to the core's 2**-126.
MIN_TEMPERATURE = 1e-3

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
#: Outputs of the plain one-shard ops (``ops.head``); any other request, and every vocab-parallel
#: call, takes ``outputs.head_outputs_call``.
_BASIC = frozenset({"log_probs", "entropy"})
#: Outputs past (log_probs, entropy) the triton backend computes (one shard and vocab-parallel).
EXTRA_OUTPUTS = ("lse", "sum_p2", "argmax", "gather")
#: Largest tile size the options take (block_m, block_n, block_k).
MAX_TILE = 1024
#: The policy loss's kept ``[rows, V]`` buffer per ``memory`` choice, in bytes, at least
#: (``policy.kept_budget``; docs/policy-loss.md).
POLICY_BUFFER_BYTES = {"low": 1024 << 20, "fast": 2048 << 20}


class TritonOptions(BaseModel):
    """One memory-or-speed choice, and tile overrides for tuning. None depends on the batch: the
    forward stays batch invariant."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory: Literal["low", "fast"] = Field(
        "low",
        description="The backward's layout. 'low': the hidden-gradient sum's low byte (fp24) is kept "
        "in the weight gradient's last rows, whose logits are recomputed once at the end (about "
        "N/(2V) GEMM units), and a 64 MiB dz buffer; 'fast': the sum's exact fp32 low half beside "
        "the output (N x H x 2 bytes) and a 256 MiB dz buffer. Both put dz blocks in the weight "
        "gradient's unwritten rows where they fit; 'low' applies when both gradients are asked.",
    )
    backward_block_mib: float | None = Field(
        default=None,
        gt=0,
        le=1 << 20,
        allow_inf_nan=False,
        description="Tuning: bound on the backward's dz[N, Vb] block buffer in MiB, at most 2**20 "
        "(1 TiB; sets Vb from N; wider blocks are faster, fewer hidden-gradient "
        "read-modify-writes). None: memory's default.",
    )
    block_m: int | None = Field(
        None,
        description="Tuning: rows per tile (power of two, 16 to 1024); None keeps the shipped "
        "per-dtype config. Tiles whose pipeline stages would not fit the GPU's shared memory are "
        "an OptionsError at the first call on that GPU (the estimate and the limit named).",
    )
    block_n: int | None = Field(
        None, description="Tuning: vocabulary columns per tile (power of two, 16 to 1024)."
    )
    block_k: int | None = Field(
        None,
        description="Tuning: hidden (reduction) step per tile iteration (power of two, 16 to 1024).",
    )
    policy_chunk_rows: int | None = Field(
        None,
        ge=1,
        description="Tuning: rows per chunk of the policy loss (None: from memory, a kept buffer "
        "of 1 GiB for 'low' and 2 GiB for 'fast', or the size of a 16-bit weight gradient where "
        "that is more: rounding its fp32 sum at the end needs as much; with a bf16 weight, "
        "every row in one chunk where they fit that and the gradient's size, with no fp32 sum).",
    )
    tma: bool | None = Field(
        None,
        description="Tuning: persistent grid with TMA loads for the logits GEMMs (Hopper+); None: "
        "shipped default.",
    )

    @field_validator("block_m", "block_n", "block_k")
    @classmethod
    def _power_of_two(cls, v: int | None) -> int | None:
        # At most 1024: two of them make a tile of at most 2**20 values, Triton's largest block.
        if v is not None and (not 16 <= v <= MAX_TILE or v & (v - 1)):
            raise ValueError(f"tile sizes must be powers of two from 16 to {MAX_TILE}, got {v}")
        return v


class TritonBackend:
    """Fused Triton kernels: fp32 statistics from tiles, fixed-order combine, blockwise backward."""

    name: ClassVar[str] = "triton"
    Options: ClassVar[type[BaseModel]] = TritonOptions
    plugin_api_version: ClassVar[int] = 2

    def __init__(self, options: TritonOptions | None = None) -> None:
        self.options = options if options is not None else TritonOptions()
        self._by_dtype: dict[torch.dtype, tuple[Settings, str]] = {}

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
            min_temperature=MIN_TEMPERATURE,
            softcap=True,
            uneven_shards=True,
            degree_invariant=True,
            vocab_grid=GRID_COLS,
            kl_directions=KL_DIRECTIONS,
            outputs=("log_probs", "entropy", *EXTRA_OUTPUTS, "topk"),
            max_top_k=MAX_TOP_K,
            vocab_parallel_outputs=("log_probs", "entropy", *EXTRA_OUTPUTS),
            policy_loss=True,
        )

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise BackendUnavailableError with the reason and the fix where the kernels can't run."""
        device = torch.device(device)
        if importlib.util.find_spec("triton") is None:
            raise BackendUnavailableError(
                "the triton backend needs the 'triton' package, which is not installed; "
                "install it with: pip install triton (on Linux with CUDA it comes with torch)"
            )
        if dtype not in _DTYPE_NAMES:
            raise BackendUnavailableError(
                f"the triton backend computes in fp32, fp16 or bf16, not {dtype}; "
                "cast hidden and weight to one of those"
            )
        # The settings are made here, where a call under torch.compile runs eagerly (the
        # core's check step): their key is json, which Dynamo cannot trace inside forward.
        self._settings(dtype)
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
            props = torch.cuda.get_device_properties(index)
            limit = getattr(props, "shared_memory_per_block_optin", None)  # torch >= 2.1
            if limit:
                self.check_shared_memory(
                    dtype, int(limit), tma=_has_tma(cap),
                    where=f"{props.name} (cuda:{index}, shared_memory_per_block_optin)",
                )  # fmt: skip
            return
        if device.type == "cpu":
            if not interp:
                testing = (  # the interpreter's bf16 dots are wrong: not advised for bf16
                    "use backend='torch' (or, in fp32 or fp16, set TRITON_INTERPRET=1 to test "
                    "the kernels on the CPU's interpreter)"
                    if dtype == torch.bfloat16
                    else "set TRITON_INTERPRET=1 to run the kernels on the CPU for testing, or "
                    "use backend='torch'"
                )
                raise BackendUnavailableError(
                    f"the triton backend runs on CUDA GPUs and this is the CPU; {testing}"
                )
            if dtype == torch.bfloat16:
                raise BackendUnavailableError(
                    "bf16 dot products are wrong under the Triton interpreter "
                    "(TRITON_INTERPRET=1); on the CPU use fp32 or fp16, or backend='torch'"
                )
            problem = interpreter_problem()
            if problem is not None:
                raise BackendUnavailableError(problem)
            return
        raise BackendUnavailableError(
            f"the triton backend runs on CUDA devices, not {device.type!r}; use backend='torch'"
        )

    def check_shared_memory(
        self, dtype: torch.dtype, limit: int, *, tma: bool, where: str = "the device"
    ) -> None:
        """Raise ``OptionsError`` where a kernel's staged tiles for ``dtype`` (this backend's
        options) would need more than ``limit`` bytes of shared memory per block, which Triton
        would only report when compiling ("out of resources"). ``configs.shared_memory_estimates``
        says what is counted; ``tma``: the device takes the TMA path (Hopper+)."""
        st, _ = self._settings(dtype)
        esize = torch.empty((), dtype=dtype).element_size()
        over = shared_memory_excess(st, esize, limit, tma=tma)
        if over is None:
            return
        o, t = self.options, over.tile
        given = [n for n in ("block_m", "block_n", "block_k") if getattr(o, n) is not None]
        tiles = f"block_m={t.block_m}, block_n={t.block_n}, block_k={t.block_k}"
        origin = (
            f"set by the options {', '.join(f'{n}={getattr(o, n)}' for n in given)}, the rest "
            "shipped"
            if given
            else f"the shipped {_DTYPE_NAMES[dtype]} tile: no block_m/block_n/block_k set"
        )
        fit = fitting_tile(
            dtype, esize, limit, tma=tma, memory=o.memory, block_m=o.block_m, block_n=o.block_n,
            block_k=o.block_k, tma_option=o.tma,
        )  # fmt: skip
        hint = "set smaller block_k, block_n or block_m"
        if fit is not None:
            hint += " (e.g. options " + ", ".join(f"{k}={v}" for k, v in fit.items()) + " fits)"
        if o.tma is not False and tma:
            hint += ", or tma=False (no TMA store tile)"
        from fusedhead.config import option_signatures

        raise OptionsError(
            f"tiles {tiles} with {t.num_stages} stages ({origin}) need about {over.nbytes} bytes "
            f"of shared memory per block in the {over.kernel} kernel ({over.terms}) for "
            f"{_DTYPE_NAMES[dtype]} inputs, more than the {limit} bytes of {where}; Triton would "
            "fail to compile it (out of resources)",
            option=given[-1] if given else None,
            expected=f"tiles whose staged operands fit {limit} bytes of shared memory",
            valid_options=option_signatures(TritonOptions),
            hint=hint,
        )

    def forward(self, call: HeadCall) -> HeadOutput:
        """fp32 log_probs [N] and entropy [N] (or None), and the requested extras,
        differentiable in hidden and weight."""
        from .launch import MAX_GRID_VOCAB, HeadScalars
        from .ops import head

        if call.vocab_size >= MAX_GRID_VOCAB:
            raise ValueError(
                f"vocab_size: the triton backend's exact (fixed-point) combine of the vocabulary "
                f"tiles takes vocabularies below {MAX_GRID_VOCAB} columns, got {call.vocab_size}"
            )

        hidden, temperature = call.hidden, call.temperature
        temp: torch.Tensor | None = None
        inv_temp = 1.0
        if isinstance(temperature, torch.Tensor):
            if temperature.requires_grad and torch.is_grad_enabled():
                raise ValueError(
                    "temperature: the triton backend does not differentiate w.r.t. a "
                    "per-token temperature; pass temperature.detach()"
                )
            temp = temperature.detach().to(device=hidden.device, dtype=torch.float32)
            temp = temp.expand(call.labels.shape).contiguous()
        else:
            inv_temp = 1.0 / float(temperature)
        softcap = float(call.softcap) if call.softcap is not None else None
        sc = HeadScalars(call.vocab_start, call.ignore_index, inv_temp, softcap)
        st, key = self._settings(hidden.dtype)
        if call.process_group is not None or not call.outputs <= _BASIC:
            from .outputs import head_outputs_call

            return head_outputs_call(call, temp, sc, st, key)
        logp, ent = head(
            hidden, call.weight, call.labels.contiguous(), temp, sc, key, call.return_entropy
        )
        return HeadOutput(logp, ent)

    def kl(self, call: KLCall) -> KLOutput:
        """fp32 [N] KL of the student and the teacher head, differentiable in the student only."""
        from .kl import kl

        return kl(call, self._settings(call.hidden.dtype)[1])

    def policy_loss(self, call: PolicyLossCall) -> PolicyLossResult:
        """The policy loss's statistics and gradients: three GEMMs per row chunk."""
        from .launch import MAX_GRID_VOCAB
        from .policy import chunk_rows, kept_budget, one_chunk_budget, policy_loss

        h, w = call.head.hidden, call.head.weight
        if w.shape[0] >= MAX_GRID_VOCAB:  # the statistics go through the head's exact combine
            raise ValueError(
                f"weight: the triton backend's exact (fixed-point) combine of the vocabulary "
                f"tiles takes vocabularies below {MAX_GRID_VOCAB} rows, got {w.shape[0]}"
            )
        budget = kept_budget(POLICY_BUFFER_BYTES[self.options.memory], w, call.need_weight_grad)
        rows = chunk_rows(
            h.shape[0], w.shape[0], h.dtype, budget, self.options.policy_chunk_rows,
            softcap=call.head.softcap is not None,
            one_chunk_bytes=one_chunk_budget(budget, w, call.need_weight_grad),
        )  # fmt: skip
        return policy_loss(call, self._settings(h.dtype)[0], rows)

    def _settings(self, dtype: torch.dtype) -> tuple[Settings, str]:
        """The call's kernel settings for ``dtype`` and their key, made once per dtype."""
        if dtype not in self._by_dtype:
            o = self.options
            mib = o.backward_block_mib
            st = settings_for(
                dtype, memory=o.memory, block_bytes=None if mib is None else int(mib * 2**20),
                block_m=o.block_m, block_n=o.block_n, block_k=o.block_k, tma=o.tma,
            )  # fmt: skip
            self._by_dtype[dtype] = (st, st.key())
        return self._by_dtype[dtype]


def _has_tma(capability: tuple[int, int]) -> bool:
    """Whether the TMA path can run on a device of ``capability`` (``launch.tma_usable``'s
    device part: Hopper+ and a triton with tensor descriptors)."""
    if capability < (9, 0):
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:  # triton < 3.4
        return False
    return True
