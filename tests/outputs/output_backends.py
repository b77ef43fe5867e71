"""In-process backends for the kit's output properties: one correct, the others each wrong in one way.

The correct one computes every output from full fp32 logits with autograd; each wrong one changes
one thing, and ``WRONG`` names the property that must catch it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from fusedhead.protocol import Capabilities, HeadCall, HeadOutput, KLCall, KLOutput


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _scaled(
    h: torch.Tensor, w: torch.Tensor, temperature: Any, softcap: float | None
) -> torch.Tensor:
    z = h.float() @ w.float().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = temperature.unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    return z / t


class OutputsRef:
    """Correct: every output and the KL of two heads from full fp32 logits."""

    name: ClassVar[str] = "outputs-ref"
    Options: ClassVar[type[BaseModel]] = NoOptions
    plugin_api_version: ClassVar[int] = 2
    declared: ClassVar[dict[str, Any]] = {}

    def __init__(self, options: NoOptions) -> None:
        self.options = options

    def capabilities(self, device: torch.device) -> Capabilities:
        return Capabilities(
            devices=("cpu",),
            outputs=("log_probs", "entropy", "lse", "sum_p2", "argmax", "topk", "gather"),
            max_top_k=128,
            kl_directions=("forward", "reverse"),
            per_token_temperature=True,
            softcap=True,
            **self.declared,
        )

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        return None

    def logits(self, call: HeadCall) -> torch.Tensor:
        # ignored rows selected out, never multiplied by 0: their NaN/Inf hidden reaches nothing
        hidden = torch.where((call.labels != call.ignore_index).unsqueeze(-1), call.hidden, 0)
        return _scaled(hidden, call.weight, call.temperature, call.softcap)

    def rank(self, logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Values and ids of the k best per row, equal values by the lower id."""
        ranked = torch.sort(logp.detach(), dim=1, descending=True, stable=True)
        ids = ranked.indices[:, :k]
        return logp.gather(1, ids), ids

    def forward(self, call: HeadCall) -> HeadOutput:
        z = self.logits(call)
        logp = torch.log_softmax(z, dim=-1)
        p = logp.exp()
        y = call.labels
        valid = y != call.ignore_index
        zero = torch.zeros((), dtype=torch.float32)
        lp = torch.where(valid, logp.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1), zero)
        out: dict[str, Any] = {"log_probs": lp}
        if "entropy" in call.outputs:
            out["entropy"] = torch.where(valid, -(p * logp).sum(-1), zero)
        if "lse" in call.outputs:
            out["lse"] = self.lse(z, valid)
        if "sum_p2" in call.outputs:
            out["sum_p2"] = self.sum_p2(call, p, valid)
        if "argmax" in call.outputs:
            out["argmax"] = self.argmax(logp, valid)
        if "topk" in call.outputs:
            vals, ids = self.rank(logp, call.top_k)
            out["topk_log_probs"] = torch.where(valid.unsqueeze(1), vals, zero)
            out["topk_ids"] = torch.where(valid.unsqueeze(1), ids, -1)
        if "gather" in call.outputs:
            assert call.gather_ids is not None
            out["gathered"] = self.gather(call, logp, valid)
        return HeadOutput(**out)

    def lse(self, z: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, torch.logsumexp(z, dim=-1), torch.zeros(()))

    def sum_p2(self, call: HeadCall, p: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, (p * p).sum(-1), torch.zeros(()))

    def argmax(self, logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, self.rank(logp, 1)[1][:, 0], -1)

    def gather(self, call: HeadCall, logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        ids = call.gather_ids
        assert ids is not None
        counted = valid.unsqueeze(1) & (ids != call.ignore_index)
        got = logp.gather(1, torch.where(counted, ids, 0))
        return torch.where(counted, got, torch.zeros(()))

    def kl(self, call: KLCall) -> KLOutput:
        ls, lt = self.kl_log_probs(call)
        return KLOutput(
            torch.where(call.valid, self.divergence(ls, lt.detach(), call.direction), 0.0)
        )

    def kl_log_probs(self, call: KLCall) -> tuple[torch.Tensor, torch.Tensor]:
        """The student's and the teacher's log-softmax, each with its temperature and softcap."""
        rows = call.valid.unsqueeze(-1)  # ignored rows selected out of both heads
        ls = torch.log_softmax(
            _scaled(torch.where(rows, call.hidden, 0), call.weight, call.temperature, call.softcap),
            -1,
        )
        lt = torch.log_softmax(
            _scaled(
                torch.where(rows, call.teacher_hidden, 0),
                call.teacher_weight,
                call.teacher_temperature,
                self.teacher_softcap(call),
            ),
            -1,
        )
        return ls, lt

    def teacher_softcap(self, call: KLCall) -> float | None:
        return call.teacher_softcap

    def divergence(self, ls: torch.Tensor, lt: torch.Tensor, direction: str) -> torch.Tensor:
        if direction == "forward":
            return (lt.exp() * (lt - ls)).sum(-1)
        return (ls.exp() * (ls - lt)).sum(-1)


class TopkTiesHigherId(OutputsRef):
    """Wrong: equal log-probs ranked by the higher id."""

    name: ClassVar[str] = "wrong-topk-ties"

    def rank(self, logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        flipped = logp.detach().flip(1)
        ranked = torch.sort(flipped, dim=1, descending=True, stable=True)
        ids = logp.shape[1] - 1 - ranked.indices[:, :k]
        return logp.gather(1, ids), ids


class ArgmaxIgnoredRows(OutputsRef):
    """Wrong: the argmax of an ignored row is its real argmax, not -1."""

    name: ClassVar[str] = "wrong-argmax-ignored"

    def argmax(self, logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.rank(logp, 1)[1][:, 0]


class GatherIgnoredRows(OutputsRef):
    """Wrong: gathered log-probs of ignored rows are not zeroed."""

    name: ClassVar[str] = "wrong-gather-ignored"

    def gather(self, call: HeadCall, logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        ids = call.gather_ids
        assert ids is not None
        counted = ids != call.ignore_index
        return torch.where(counted, logp.gather(1, torch.where(counted, ids, 0)), torch.zeros(()))


class GatherNotBitwise(OutputsRef):
    """Wrong (subtly): gathered values one ulp off log_probs (within tolerance, not bitwise)."""

    name: ClassVar[str] = "wrong-gather-bits"

    def gather(self, call: HeadCall, logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        got = super().gather(call, logp, valid)
        off = got.detach().nextafter(torch.full_like(got, 1e9)) - got.detach()
        return got + torch.where(got != 0, off, 0.0)


class LseGradDropped(OutputsRef):
    """Wrong: the log-sum-exp carries no gradient (still attached to the graph)."""

    name: ClassVar[str] = "wrong-lse-grad"

    def lse(self, z: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        value = super().lse(z, valid)
        return value.detach() + 0 * value


class SumP2WithoutTemperature(OutputsRef):
    """Wrong: the sum of squared probabilities of the untempered logits."""

    name: ClassVar[str] = "wrong-sum-p2"

    def sum_p2(self, call: HeadCall, p: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        q = torch.softmax(_scaled(call.hidden, call.weight, 1.0, call.softcap), -1)
        return torch.where(valid, (q * q).sum(-1), torch.zeros(()))


class PaddedVocabExtras(OutputsRef):
    """Wrong: the extras' softmax covers a vocabulary padded to a multiple of 128 with zero logits."""

    name: ClassVar[str] = "wrong-extras-padded"

    def lse(self, z: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        pad = -z.shape[1] % 128
        return super().lse(torch.cat([z, z.new_zeros(z.shape[0], pad)], 1), valid)


class KLTeacherGradient(OutputsRef):
    """Wrong: the teacher head is differentiated too."""

    name: ClassVar[str] = "wrong-kl-teacher-grad"

    def kl(self, call: KLCall) -> KLOutput:
        ls, lt = self.kl_log_probs(call)
        return KLOutput(torch.where(call.valid, self.divergence(ls, lt, call.direction), 0.0))


class KLReverseIsForward(OutputsRef):
    """Wrong: returns the forward KL when the reverse one is asked for."""

    name: ClassVar[str] = "wrong-kl-direction"

    def divergence(self, ls: torch.Tensor, lt: torch.Tensor, direction: str) -> torch.Tensor:
        return super().divergence(ls, lt, "forward")


class KLTeacherSoftcapIgnored(OutputsRef):
    """Wrong: the teacher's softcap is dropped (the student's is applied)."""

    name: ClassVar[str] = "wrong-kl-teacher-softcap"

    def teacher_softcap(self, call: KLCall) -> float | None:
        return None


class RowwiseRef(OutputsRef):
    """Correct and batch invariant: each row's logits from its own one-row GEMM."""

    name: ClassVar[str] = "outputs-ref-rowwise"
    declared: ClassVar[dict[str, Any]] = {"batch_invariant": True}

    def logits(self, call: HeadCall) -> torch.Tensor:
        rows = [
            _scaled(
                call.hidden[i : i + 1],
                call.weight,
                call.temperature[i : i + 1]
                if isinstance(call.temperature, torch.Tensor)
                else call.temperature,
                call.softcap,
            )
            for i in range(call.hidden.shape[0])
        ]
        return torch.cat(rows) if rows else _scaled(call.hidden, call.weight, 1.0, None)


class ExtrasNotBatchInvariant(RowwiseRef):
    """Wrong: declares batch_invariant, but its log-sum-exp depends on the batch size in the last bits."""

    name: ClassVar[str] = "wrong-extras-batch"

    def lse(self, z: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        blocks = torch.tensor_split(z, 1 + z.shape[0] % 5, dim=1)
        m = z.detach().max(-1, keepdim=True).values
        s = sum(torch.exp(b - m).sum(-1, keepdim=True) for b in blocks)
        return torch.where(valid, (m + torch.log(s)).squeeze(-1), torch.zeros(()))


#: Each wrong backend and the property that must fail it.
WRONG: dict[type, str] = {
    TopkTiesHigherId: "topk_accuracy",
    ArgmaxIgnoredRows: "argmax_accuracy",
    GatherIgnoredRows: "gather_accuracy",
    GatherNotBitwise: "gather_accuracy",
    LseGradDropped: "lse_and_sum_p2",
    SumP2WithoutTemperature: "lse_and_sum_p2",
    PaddedVocabExtras: "extras_together",
    KLTeacherGradient: "kl_accuracy",
    KLReverseIsForward: "kl_accuracy",
    KLTeacherSoftcapIgnored: "kl_accuracy",
    ExtrasNotBatchInvariant: "batch_invariant_extras",
}
ALL: tuple[type, ...] = (OutputsRef, RowwiseRef, *WRONG)


def register_all() -> None:
    from fusedhead import registry

    for cls in ALL:
        registry.register_backend(cls.name, cls, replace=True)
    registry.refresh()


def unregister_all() -> None:
    from fusedhead import registry

    for cls in ALL:
        registry.unregister_backend(cls.name)
    registry.refresh()
