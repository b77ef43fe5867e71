"""In-process backends for testing the conformance kit: correct ones (two declaring a
min_temperature), and eight each wrong in one way.

Importable by module name (the kit's spawned vocab-parallel ranks re-register the class from
``module:qualname``); ``register_all()`` registers them, ``pytest -p kit_backends`` too.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from fusedhead.protocol import Capabilities, HeadCall, HeadOutput
from fusedhead.reference import reference_fused_head


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _AllReduce(torch.autograd.Function):
    """Sum over the group; identity backward (every rank already holds the replicated upstream)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _ReduceGrad(torch.autograd.Function):
    """Identity forward; sums the gradient over the group (reduce_hidden_grad=True)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class KitRef:
    """Correct: full fp32 logits through autograd; vocab-parallel by hand with uneven shards."""

    name: ClassVar[str] = "kit-ref"
    Options: ClassVar[type[BaseModel]] = NoOptions
    plugin_api_version: ClassVar[int] = 2
    declared: ClassVar[dict[str, Any]] = {
        "deterministic": True,
        "per_token_temperature": True,
        "softcap": True,
        "vocab_parallel": True,
        "uneven_shards": True,
    }

    def __init__(self, options: NoOptions) -> None:
        self.options = options

    def capabilities(self, device: torch.device) -> Capabilities:
        return Capabilities(devices=("cpu",), **self.declared)

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        return None

    def logits(
        self, hidden: torch.Tensor, weight: torch.Tensor, temperature: Any, softcap: float | None
    ) -> torch.Tensor:
        z = hidden.float() @ weight.float().T
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        t = temperature.unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
        return z / t

    def forward(self, call: HeadCall) -> HeadOutput:
        lp, ent = self.compute(
            call.hidden,
            call.weight,
            call.labels,
            temperature=call.temperature,
            ignore_index=call.ignore_index,
            return_entropy=call.return_entropy,
            process_group=call.process_group,
            vocab_start=call.vocab_start,
            vocab_size=call.vocab_size,
            reduce_hidden_grad=call.reduce_hidden_grad,
            softcap=call.softcap,
        )
        return HeadOutput(lp, ent)

    def compute(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: Any,
        ignore_index: int,
        return_entropy: bool,
        process_group: Any,
        vocab_start: int,
        vocab_size: int,
        reduce_hidden_grad: bool,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if process_group is None:
            return self.single(
                hidden, weight, labels, temperature, ignore_index, return_entropy, softcap
            )
        if reduce_hidden_grad:
            hidden = _ReduceGrad.apply(hidden, process_group)
        z = self.logits(hidden, weight, temperature, softcap)
        m = z.detach().max(-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=process_group)
        e = torch.exp(z - m.unsqueeze(-1))
        s = _AllReduce.apply(e.sum(-1), process_group)
        sz = _AllReduce.apply((e * z).sum(-1), process_group)
        local = labels - vocab_start
        mine = (local >= 0) & (local < weight.shape[0])
        z_y = z.gather(1, torch.where(mine, local, 0).unsqueeze(-1)).squeeze(-1) * mine
        z_y = _AllReduce.apply(z_y, process_group)
        lse = m + torch.log(s)
        valid = labels != ignore_index
        in_range = (labels >= 0) & (labels < vocab_size)
        lp = torch.where(valid, z_y - lse, 0.0)
        lp = torch.where(valid & ~in_range, float("nan"), lp)
        ent = torch.where(valid, lse - sz / s, 0.0)
        return lp, ent if return_entropy else None

    def single(self, hidden, weight, labels, temperature, ignore_index, return_entropy, softcap):  # type: ignore[no-untyped-def]
        return reference_fused_head(
            hidden,
            weight,
            labels,
            temperature=temperature,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
            softcap=softcap,
            compute_dtype=torch.float32,
        )


class _Plain(KitRef):
    """Correct, single-process only, declares nothing optional: the base of the wrong backends."""

    declared: ClassVar[dict[str, Any]] = {}


class PaddedVocab(_Plain):
    """Wrong: pads the vocabulary to a multiple of 128 with zero rows that enter the log-sum-exp."""

    name: ClassVar[str] = "wrong-padded-vocab"

    def single(self, hidden, weight, labels, temperature, ignore_index, return_entropy, softcap):  # type: ignore[no-untyped-def]
        pad = -weight.shape[0] % 128
        padded = torch.cat([weight, weight.new_zeros(pad, weight.shape[1])])
        return super().single(
            hidden, padded, labels, temperature, ignore_index, return_entropy, softcap
        )


class IgnoredNotZeroed(_Plain):
    """Wrong: rows labelled ignore_index are scored as if their label were token 0."""

    name: ClassVar[str] = "wrong-ignored-rows"

    def single(self, hidden, weight, labels, temperature, ignore_index, return_entropy, softcap):  # type: ignore[no-untyped-def]
        labels = torch.where(labels == ignore_index, 0, labels)
        return super().single(
            hidden, weight, labels, temperature, ignore_index, return_entropy, softcap
        )


class EntropyGradDropped(_Plain):
    """Wrong: the entropy's gradient is zero (still attached to the graph, so only the kit sees it)."""

    name: ClassVar[str] = "wrong-entropy-grad"

    def single(self, hidden, weight, labels, temperature, ignore_index, return_entropy, softcap):  # type: ignore[no-untyped-def]
        lp, ent = super().single(
            hidden, weight, labels, temperature, ignore_index, return_entropy, softcap
        )
        return lp, None if ent is None else ent.detach() + 0 * ent


class TemperatureMissingInBackward(_Plain):
    """Wrong: forward divides by the temperature, backward forgets to (dz instead of dz / T)."""

    name: ClassVar[str] = "wrong-temperature-backward"

    def single(self, hidden, weight, labels, temperature, ignore_index, return_entropy, softcap):  # type: ignore[no-untyped-def]
        z = hidden.float() @ weight.float().T
        z = (z / temperature).detach() + (z - z.detach())  # value z / T, gradient as if T = 1
        eye = torch.eye(z.shape[1], dtype=z.dtype)
        return reference_fused_head(
            z,
            eye,
            labels,
            temperature=1.0,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
            compute_dtype=torch.float32,
        )


class FakeBatchInvariant(_Plain):
    """Wrong: declares batch_invariant but splits the vocabulary into N-dependent blocks."""

    name: ClassVar[str] = "wrong-batch-invariance"
    declared: ClassVar[dict[str, Any]] = {"batch_invariant": True}

    def single(self, hidden, weight, labels, temperature, ignore_index, return_entropy, softcap):  # type: ignore[no-untyped-def]
        hidden = torch.where((labels != ignore_index).unsqueeze(-1), hidden, 0)  # select out
        z = (hidden.float() @ weight.float().T) / temperature
        blocks = torch.tensor_split(z, 1 + hidden.shape[0] % 5, dim=1)
        m = z.detach().max(-1, keepdim=True).values
        s = sum(torch.exp(b - m).sum(-1, keepdim=True) for b in blocks)
        sz = sum((torch.exp(b - m) * b).sum(-1, keepdim=True) for b in blocks)
        lse = (m + torch.log(s)).squeeze(-1)
        valid = labels != ignore_index
        in_range = (labels >= 0) & (labels < z.shape[1])
        z_y = z.gather(1, torch.where(valid & in_range, labels, 0).unsqueeze(-1)).squeeze(-1)
        lp = torch.where(valid, z_y - lse, 0.0)
        lp = torch.where(valid & ~in_range, float("nan"), lp)
        ent = torch.where(valid, lse - (sz / s).squeeze(-1), 0.0)
        return lp, ent if return_entropy else None


class WritesLabels(_Plain):
    """Wrong: right values, then it zeroes the ignored labels in the caller's own tensor."""

    name: ClassVar[str] = "wrong-writes-labels"

    def single(self, hidden, weight, labels, temperature, ignore_index, return_entropy, softcap):  # type: ignore[no-untyped-def]
        out = super().single(
            hidden, weight, labels, temperature, ignore_index, return_entropy, softcap
        )
        labels.masked_fill_(labels == ignore_index, 0)
        return out


class CleansHidden(_Plain):
    """Wrong: right values, after zeroing the NaN/Inf of the hidden states in the caller's own
    tensor (the padding rows an unchecked call hands over)."""

    name: ClassVar[str] = "wrong-cleans-hidden"

    def single(self, hidden, weight, labels, temperature, ignore_index, return_entropy, softcap):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            hidden.nan_to_num_(0.0, 0.0, 0.0)
        return super().single(
            hidden, weight, labels, temperature, ignore_index, return_entropy, softcap
        )


class ClampsInfHidden(_Plain):
    """Wrong: right values, after clamping the caller's +-Inf hidden states to fp32's range in
    place (NaN left alone): a comparison through ``nan_to_num`` saw nothing change."""

    name: ClassVar[str] = "wrong-clamps-inf-hidden"

    def single(self, hidden, weight, labels, temperature, ignore_index, return_entropy, softcap):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            big = torch.finfo(hidden.dtype).max
            hidden.clamp_(-big, big)
        return super().single(
            hidden, weight, labels, temperature, ignore_index, return_entropy, softcap
        )


class ReusedOutputs(_Plain):
    """Wrong: right values, written under no_grad into one buffer it keeps for every call."""

    name: ClassVar[str] = "wrong-reused-outputs"
    buffer: ClassVar[dict[tuple[int, str], torch.Tensor]] = {}

    def single(self, hidden, weight, labels, temperature, ignore_index, return_entropy, softcap):  # type: ignore[no-untyped-def]
        lp, ent = super().single(
            hidden, weight, labels, temperature, ignore_index, return_entropy, softcap
        )
        if torch.is_grad_enabled():
            return lp, ent
        out = []
        for what, t in (("lp", lp), ("ent", ent)):
            if t is None:
                out.append(None)
                continue
            buf = self.buffer.setdefault((t.shape[0], what), torch.empty_like(t))
            out.append(buf.copy_(t))
        return out[0], out[1]


class MinTemperature(KitRef):
    """Correct, and declares min_temperature=0.1 (triton's is 1e-3): the kit must test at and
    above it, never below, where the core refuses the call."""

    name: ClassVar[str] = "kit-min-temperature"
    declared: ClassVar[dict[str, Any]] = {**KitRef.declared, "min_temperature": 0.1}


class HighMinTemperature(KitRef):
    """Correct, and declares a minimum above every temperature the kit picks on its own (20)."""

    name: ClassVar[str] = "kit-high-min-temperature"
    declared: ClassVar[dict[str, Any]] = {**KitRef.declared, "min_temperature": 25.0}


#: Correct backends that declare a min_temperature, by it.
MIN_TEMPERATURE: dict[float, type] = {0.1: MinTemperature, 25.0: HighMinTemperature}


#: Each wrong backend and the property the kit must fail it on.
WRONG = {
    PaddedVocab: "odd_shapes",
    IgnoredNotZeroed: "ignore_index",
    EntropyGradDropped: "backward_accuracy",
    TemperatureMissingInBackward: "temperature",
    FakeBatchInvariant: "batch_invariance",
    WritesLabels: "inputs_unchanged",
    CleansHidden: "inputs_unchanged",
    ClampsInfHidden: "inputs_unchanged",
    ReusedOutputs: "fresh_outputs",
}
ALL: tuple[type, ...] = (KitRef, *MIN_TEMPERATURE.values(), *WRONG)


def register(classes: tuple[type, ...]) -> None:
    """Each class registered in-process under its own name."""
    from fusedhead import registry

    for cls in classes:
        registry.register_backend(cls.name, cls, replace=True)
    registry.refresh()


def unregister(classes: tuple[type, ...]) -> None:
    from fusedhead import registry

    for cls in classes:
        registry.unregister_backend(cls.name)
    registry.refresh()


def register_all() -> None:
    register(ALL)


def unregister_all() -> None:
    unregister(ALL)


def pytest_configure(config: Any) -> None:
    """Loaded with ``pytest -p kit_backends``: register the backends for that session."""
    register_all()
