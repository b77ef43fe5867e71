"""The ``liger`` backend: liger-kernel's fused linear scaled cross-entropy, chosen explicitly.

``implementation="native"`` runs Liger's SM90 CuTe DSL kernel and nothing else; ``"fallback"``
runs Liger's 512-row chunked (verl-derived) path on purpose, on the CPU or a CUDA GPU in fp32, fp16
or bf16, and is the one that supports vocab-parallel. Liger's own device dispatch is never used.
Every check names a missing or unsupported liger-kernel first (``_liger.require_liger``).

Under ``torch.compile`` the Liger call runs eagerly behind a graph break (``_untraced``): Liger's
functions read the labels on the host, a data-dependent check Dynamo cannot put in a graph, so
``fullgraph=True`` stops there with the reason.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from fusedhead.errors import BackendError, BackendUnavailableError
from fusedhead.graph import tracing
from fusedhead.protocol import Capabilities, HeadCall, HeadOutput
from fusedhead.shards import (
    check_shards,
    gathered_shards,
    shard_slots_tensor,
    shards_need_check,
)
from fusedhead_liger import _liger, _run, availability

Implementation = Literal["native", "fallback"]

_FALLBACK_DEVICES = ("cpu", "cuda")
_NATIVE_KERNEL = "LigerFusedScaledCrossEntropySM90Function (CuTe DSL, SM90, bf16)"
_FALLBACK_KERNEL = "Liger's 512-row chunked path adapted from verl (torch ops)"


class LigerOptions(BaseModel):
    """Options of the ``liger`` backend."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    implementation: Implementation = Field(
        default="native",
        description=(
            "native: Liger's SM90 CuTe DSL kernel only (H100/H200, bf16), an error anywhere else; "
            "fallback: Liger's chunked verl-style path, CPU or CUDA, fp32/fp16/bf16, "
            "vocab-parallel"
        ),
    )


class LigerBackend:
    """fusedhead backend over liger-kernel 0.8.5 with the implementation named, never guessed."""

    name: ClassVar[str] = "liger"
    Options: ClassVar[type[BaseModel]] = LigerOptions
    plugin_api_version: ClassVar[int] = 2

    def __init__(self, options: LigerOptions | None = None) -> None:
        self.options = options if options is not None else LigerOptions()
        self._checked: set[tuple[torch.device, torch.dtype]] = set()

    @property
    def implementation(self) -> Implementation:
        return self.options.implementation

    def capabilities(self, device: torch.device) -> Capabilities:
        """What the selected implementation does; precisions are where Liger rounds."""
        if self.implementation == "native":
            # Logits are staged through fp16 shared memory; entropy is written as bf16.
            return Capabilities.model_validate(
                {
                    "devices": ("cuda",),
                    "dtypes": ("bf16",),
                    "vocab_parallel": False,
                    "logits_precision": "fp16",
                    "entropy_precision": "bf16",
                    "implementation": "native",
                    "kernel": _NATIVE_KERNEL,
                }
            )
        # The chunk GEMM's output (the logits) is in the input dtype, and the single-process
        # path returns entropy in the input dtype: fp32 for fp32 inputs, fp16/bf16 otherwise.
        # One field cannot say "the input dtype", so it declares the coarsest one it takes and
        # gives the exact map in an extra field.
        return Capabilities.model_validate(
            {
                "devices": _FALLBACK_DEVICES,
                "dtypes": ("fp32", "fp16", "bf16"),
                "vocab_parallel": True,
                "logits_precision": "bf16",
                "entropy_precision": "bf16",
                "implementation": "fallback",
                "kernel": _FALLBACK_KERNEL,
                "precision_by_dtype": {
                    d: {"logits": d, "entropy": d} for d in ("fp32", "fp16", "bf16")
                },
                # Liger divides fp16 logits by T in fp16 (inf past 65504): below T = 1, where
                # the logits' bound says they could, the single-process path runs on fp32
                # copies of hidden and weight (_run.widen_fp16).
                "fp16_in_fp32_where": _run.FP16_WIDEN_RULE,
                "traces_fullgraph": False,
            }
        )

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise ``BackendUnavailableError`` with the reason and the fix when it cannot run here;
        first ``MissingDependencyError`` where liger-kernel is missing or of another version, on
        either implementation. Liger's functions are resolved here, where a compiled call runs
        the check eagerly, and the pair is recorded so ``forward`` does not check it again."""
        device = torch.device(device)
        _liger.require_liger()
        if self.implementation == "native":
            reasons = availability.native_reasons(device, dtype)
            if reasons:
                raise BackendUnavailableError(
                    availability.native_unavailable_message(device, dtype, reasons)
                )
        else:
            if device.type not in _FALLBACK_DEVICES:
                raise BackendUnavailableError(
                    f"backend 'liger' with implementation='fallback' runs on "
                    f"{list(_FALLBACK_DEVICES)}, not {device.type!r}; use another backend"
                )
            _liger.fallback_function()  # imports liger-kernel; the names the adapter calls exist
            _liger.tp_fallback_function()
        self._checked.add((device, dtype))

    def describe(self, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
        """Which implementation would run on ``device`` for ``dtype`` inputs, and why."""
        device = torch.device(device)
        info = {
            "implementation": self.implementation,
            "dtype": str(dtype).removeprefix("torch."),
        }
        try:
            self.check(device, dtype)
        except BackendError as exc:  # liger-kernel missing or broken as well as unavailable
            info |= {"would_run": "no", "reason": str(exc)}
        else:
            info["would_run"] = "yes"
            if self.implementation == "native":
                info["reason"] = f"{device} is an SM90 GPU and Liger's CuTe DSL kernel imports"
            else:
                info["reason"] = (
                    "implementation='fallback' was chosen: Liger's chunked path runs on purpose"
                )
        info["kernel"] = _NATIVE_KERNEL if self.implementation == "native" else _FALLBACK_KERNEL
        info["liger_kernel"] = _liger.distribution_version("liger-kernel") or "not installed"
        info["cute_dsl"] = _liger.distribution_version("nvidia-cutlass-dsl") or "not installed"
        return info

    def forward(self, call: HeadCall) -> HeadOutput:
        """fp32 ``(log_probs, entropy)`` from Liger's ``(nll, entropy)``."""
        hidden, temperature = call.hidden, call.temperature
        if call.softcap is not None:
            raise BackendUnavailableError("backend 'liger' has no softcap; use backend='torch'")
        if isinstance(temperature, torch.Tensor):
            raise BackendUnavailableError(
                "backend 'liger' takes one float temperature, not a per-token tensor"
            )
        if (hidden.device, hidden.dtype) not in self._checked:
            self.check(hidden.device, hidden.dtype)
        if tracing():  # Liger's host-side label checks do not trace: run it eagerly
            from fusedhead_liger import _untraced

            return _untraced.run(self.run_liger, call)
        return self.run_liger(call)

    def run_liger(self, call: HeadCall) -> HeadOutput:
        """The call through Liger, after ``check``: labels guarded, Liger run, outputs mapped."""
        hidden, weight, ignore_index = call.hidden, call.weight, call.ignore_index
        temperature, return_entropy = float(call.temperature), call.return_entropy
        safe, bad = _run.guard_labels(call.labels, ignore_index, call.vocab_size)
        hidden, weight = _run.liger_inputs(hidden, weight, safe, ignore_index)
        if call.process_group is None:
            run = _run.run_native if self.implementation == "native" else _run.run_fallback
            nll, entropy = run(hidden, weight, safe, temperature, ignore_index, return_entropy)
        else:
            self._check_shards(weight, call.process_group, call.vocab_start, call.vocab_size)
            nll, entropy = _run.run_tp_fallback(
                hidden,
                weight,
                safe,
                temperature,
                ignore_index,
                return_entropy,
                call.process_group,
                call.reduce_hidden_grad,
            )
        return HeadOutput(*_run.to_contract(nll, entropy, bad))

    def _check_shards(
        self, weight: torch.Tensor, process_group: Any, vocab_start: int, vocab_size: int
    ) -> None:
        """Vocab-parallel runs through Liger's chunked TP path, which needs equal shards in rank
        order, and every rank's shard must agree with the others' (``_check_union``)."""
        if self.implementation == "native":
            raise BackendUnavailableError(
                "backend 'liger' with implementation='native' does not run vocab-parallel: Liger's "
                "native TP kernel needs the separate liger-cute-kernels package and an NVSHMEM team, "
                "which fusedhead-liger neither installs nor tests. Use "
                'options={"implementation": "fallback"} (Liger\'s chunked TP path over '
                "torch.distributed) or another backend"
            )
        import torch.distributed as dist

        rank = dist.get_rank(process_group)
        world = dist.get_world_size(process_group)
        local = weight.shape[0]
        # The union first: it is a collective, so every rank reaches it before any rank raises.
        _check_union(weight.device, process_group, rank, world, (vocab_start, local, vocab_size))
        if (vocab_start, vocab_size) != (rank * local, world * local):
            raise BackendUnavailableError(
                f"backend 'liger' needs equal contiguous vocabulary shards in rank order: rank {rank} "
                f"of {world} holds {local} rows, so vocab_start={rank * local} and "
                f"vocab_size={world * local}, got vocab_start={vocab_start}, vocab_size={vocab_size}"
            )


def _check_union(
    device: torch.device, group: Any, rank: int, world: int, shard: tuple[int, int, int]
) -> None:
    """Every rank's (vocab_start, rows, vocab_size) through the core's ``check_shards``: a gap,
    an overlap or a disagreeing vocab_size is the same ``ValueError`` on every rank (each rank's
    own check passes 400 rows of 800 beside 600 of 1200). Liger's TP function has no collective
    to carry the bounds, so this costs one all-gather of ``SHARD_FLOATS`` fp32 per rank on every
    forward (read on CUDA only on a layout's first call, as in the torch and triton backends)."""
    import torch.distributed as dist

    mine = shard_slots_tensor(*shard, device)  # [1, SHARD_FLOATS], never written to
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)  # every call on every rank: collectives must match
    if not torch.compiler.is_compiling() and shards_need_check(group, *shard, device):
        layout = torch.cat(parts)
        check_shards(layout, rank, group, *shard)
        _check_rank_order(gathered_shards(layout), rank)


def _check_rank_order(shards: list[tuple[int, int, int]], rank: int) -> None:
    """Liger's TP path needs equal shards in rank order. Judged from every rank's shard, so a
    layout that covers the vocabulary but not so (3 ranks: 300, 200, 400 rows of 900; or equal
    shards out of order) is the same error on every rank, not an error on some ranks while the
    others wait in Liger's collectives."""
    world = len(shards)
    bad = [r for r, (a, w, s) in enumerate(shards) if (a, s) != (r * w, world * w)]
    if bad:
        shown = ", ".join(f"rank {r}: [{a}, {a + w}) of {s}" for r, (a, w, s) in enumerate(shards))
        raise BackendUnavailableError(
            f"backend 'liger' needs equal contiguous vocabulary shards in rank order (rank r "
            f"holding [r * rows, (r + 1) * rows) of world * rows); ranks {bad} do not ({shown}); "
            f"this is rank {rank}. Use backend='torch' or 'triton' for other layouts"
        )
