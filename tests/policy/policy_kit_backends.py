"""In-process backends for the kit's policy-loss properties: one correct, the others each wrong in one way.

The correct one computes each row's log-prob and entropy from full fp32 logits with autograd and
the loss's gradients as that head's backward with upstream ``policy_terms.token_grads``; each
wrong one changes one thing, and ``WRONG`` names the property that must catch it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from fusedhead.policy_terms import KL_BOUND, LOG_RATIO_BOUND, TokenTerms, token_grads
from fusedhead.protocol import (
    Capabilities,
    HeadCall,
    HeadOutput,
    PolicyLossCall,
    PolicyLossResult,
)


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyRef:
    """Correct: full fp32 logits, ignored rows selected out, gradients by autograd."""

    name: ClassVar[str] = "policy-ref"
    Options: ClassVar[type[BaseModel]] = NoOptions
    plugin_api_version: ClassVar[int] = 2
    declared: ClassVar[dict[str, Any]] = {"policy_loss": True, "deterministic": True}

    def __init__(self, options: NoOptions) -> None:
        self.options = options

    def capabilities(self, device: torch.device) -> Capabilities:
        return Capabilities(devices=("cpu",), **self.declared)

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        return None

    def rows(self, call: HeadCall, h: torch.Tensor) -> torch.Tensor:
        """The hidden rows the GEMM sees: ignored ones replaced by zeros."""
        valid = (call.labels != call.ignore_index).unsqueeze(1)
        return torch.where(valid, h, torch.zeros((), dtype=h.dtype))

    def stats(
        self, call: HeadCall, h: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        temp = call.temperature  # a per-token one ([N], where declared) divides its row
        temp = temp.reshape(-1, 1) if isinstance(temp, torch.Tensor) else temp
        z = self.rows(call, h).float() @ w.float().T / temp
        logp = torch.log_softmax(z, dim=-1)
        valid = call.labels != call.ignore_index
        zero = torch.zeros((), dtype=torch.float32)
        in_range = (call.labels >= 0) & (call.labels < w.shape[0])  # unchecked calls: NaN rows
        lp = logp.gather(1, torch.where(in_range, call.labels, 0).unsqueeze(1)).squeeze(1)
        lp = torch.where(in_range, lp, torch.nan)
        ent = -(logp.exp() * logp).sum(-1)
        return torch.where(valid, lp, zero), torch.where(valid, ent, zero)

    def forward(self, call: HeadCall) -> HeadOutput:
        lp, ent = self.stats(call, call.hidden, call.weight)
        return HeadOutput(log_probs=lp, entropy=ent if "entropy" in call.outputs else None)

    def terms(self, call: PolicyLossCall, lp: torch.Tensor, ent: torch.Tensor) -> TokenTerms:
        return token_grads(call, 0, lp.shape[0], lp, ent)

    def grads(
        self, call: PolicyLossCall, gh: torch.Tensor, gw: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (
            gh if call.need_hidden_grad else None,
            gw if call.need_weight_grad else None,
        )

    def policy_loss(self, call: PolicyLossCall) -> PolicyLossResult:
        head = call.head
        with torch.enable_grad():
            h = head.hidden.detach().requires_grad_(True)
            w = head.weight.detach().requires_grad_(True)
            lp, ent = self.stats(head, h, w)
            t = self.terms(call, lp.detach(), ent.detach())
            gh, gw = torch.autograd.grad(
                [lp, ent], [h, w], [t.grad_log_probs, t.grad_entropy], allow_unused=True
            )
        gh = torch.zeros_like(h) if gh is None else gh
        gw = torch.zeros_like(w) if gw is None else gw
        grad_h, grad_w = self.grads(call, gh, gw)
        return PolicyLossResult(lp.detach(), ent.detach(), grad_hidden=grad_h, grad_weight=grad_w)


class Undeclared(PolicyRef):
    """Right, but declares no policy_loss: every policy property is not run."""

    name: ClassVar[str] = "policy-undeclared"
    declared: ClassVar[dict[str, Any]] = {"deterministic": True}


class HotPerToken(PolicyRef):
    """Right: per-token temperatures and a min_temperature of 2 (every temperature the kit
    passes is raised to it, on ignored rows too, where junk is the point)."""

    name: ClassVar[str] = "policy-hot-per-token"
    declared: ClassVar[dict[str, Any]] = {
        "policy_loss": True,
        "deterministic": True,
        "per_token_temperature": True,
        "min_temperature": 2.0,
    }


class IgnoresDualClip(PolicyRef):
    """Wrong: its gradients leave out the dual clip (the core's loss value still has it)."""

    name: ClassVar[str] = "wrong-policy-dual-clip"

    def terms(self, call: PolicyLossCall, lp: torch.Tensor, ent: torch.Tensor) -> TokenTerms:
        return super().terms(dataclasses.replace(call, dual_clip=None), lp, ent)


class NoEntropyGradient(PolicyRef):
    """Wrong: the entropy bonus's gradient is dropped."""

    name: ClassVar[str] = "wrong-policy-entropy-grad"

    def terms(self, call: PolicyLossCall, lp: torch.Tensor, ent: torch.Tensor) -> TokenTerms:
        t = super().terms(call, lp, ent)
        return t._replace(grad_entropy=torch.zeros_like(t.grad_entropy))


class MasksByMultiplying(PolicyRef):
    """Wrong: ignored rows multiplied by 0 instead of selected out (0 * NaN is NaN)."""

    name: ClassVar[str] = "wrong-policy-mask"

    def rows(self, call: HeadCall, h: torch.Tensor) -> torch.Tensor:
        return h * (call.labels != call.ignore_index).unsqueeze(1).to(h.dtype)


class ReusedBuffers(PolicyRef):
    """Wrong: hands out the same gradient buffers on every call (a persistent workspace), so
    autograd's ``.grad`` of one micro-batch is overwritten by the next call."""

    name: ClassVar[str] = "wrong-policy-buffers"

    def __init__(self, options: NoOptions) -> None:
        super().__init__(options)
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def grads(
        self, call: PolicyLossCall, gh: torch.Tensor, gw: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        out = []
        for which, g in (("h", gh), ("w", gw)):
            key = (which, tuple(g.shape), g.dtype)
            buf = self.buffers.setdefault(key, torch.empty_like(g))
            out.append(buf.copy_(g))
        return super().grads(call, out[0], out[1])


class ReusedWeightBuffer(PolicyRef):
    """Wrong: one weight-gradient buffer for every call. With a backward after each call
    autograd copies it into ``.grad`` before the next call writes it; two forwards before one
    backward (two losses summed) hand out the second call's gradient twice."""

    name: ClassVar[str] = "wrong-policy-weight-buffer"

    def __init__(self, options: NoOptions) -> None:
        super().__init__(options)
        self.buffer: torch.Tensor | None = None

    def grads(
        self, call: PolicyLossCall, gh: torch.Tensor, gw: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.buffer is None or self.buffer.shape != gw.shape or self.buffer.dtype != gw.dtype:
            self.buffer = torch.empty_like(gw)
        return super().grads(call, gh, self.buffer.copy_(gw))


class NotDeterministic(PolicyRef):
    """Wrong: declares deterministic, but its weight gradient varies in the last bits run to run
    (as an unordered atomic reduction would), well within the accuracy bounds."""

    name: ClassVar[str] = "wrong-policy-determinism"

    def grads(
        self, call: PolicyLossCall, gh: torch.Tensor, gw: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        noise = torch.randn(gw.shape) * 1e-7 * gw.abs()  # the global generator: not seeded
        return super().grads(call, gh, gw + noise.to(gw.dtype))


class GradientsNobodyAskedFor(PolicyRef):
    """Wrong: returns both gradients whatever the call needs."""

    name: ClassVar[str] = "wrong-policy-grads"

    def grads(
        self, call: PolicyLossCall, gh: torch.Tensor, gw: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return gh, gw


class ZeroesIgnoredAdvantages(PolicyRef):
    """Wrong: right values, after zeroing the advantages of ignored rows in the caller's tensor
    (an unchecked call hands it over as it is)."""

    name: ClassVar[str] = "wrong-policy-writes-advantages"

    def policy_loss(self, call: PolicyLossCall) -> PolicyLossResult:
        ignored = call.head.labels == call.head.ignore_index
        call.advantages.masked_fill_(ignored.reshape(call.advantages.shape), 0.0)
        return super().policy_loss(call)


class ReusedStatistics(PolicyRef):
    """Wrong: right values, but its log-probs and entropy come in buffers it keeps and refills on
    every call, so an earlier call's statistics change under the caller."""

    name: ClassVar[str] = "wrong-policy-statistics-buffer"

    def __init__(self, options: NoOptions) -> None:
        super().__init__(options)
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}

    def policy_loss(self, call: PolicyLossCall) -> PolicyLossResult:
        result = super().policy_loss(call)
        lp, ent = (
            self.buffers.setdefault((k, t.shape[0]), torch.empty_like(t)).copy_(t)
            for k, t in (("lp", result.log_probs), ("ent", result.entropy))
        )
        return dataclasses.replace(result, log_probs=lp, entropy=ent)


class RatioUnclamped(PolicyRef):
    """Wrong: the ratio's gradient without verl's clamp of the log-ratio to [-20, 20]: a token
    past it with a negative advantage (no dual clip) gets ``-A e^(lp - old)``, not 0."""

    name: ClassVar[str] = "wrong-policy-ratio-clamp"

    def terms(self, call: PolicyLossCall, lp: torch.Tensor, ent: torch.Tensor) -> TokenTerms:
        t = super().terms(call, lp, ent)
        if call.old_log_probs is None or call.dual_clip is not None:
            return t
        log_ratio, adv = lp - call.old_log_probs, call.advantages
        past = (log_ratio > LOG_RATIO_BOUND) & (adv < 0) & (call.token_weight != 0)
        extra = -adv * torch.exp(log_ratio) * call.token_weight
        return t._replace(grad_log_probs=t.grad_log_probs + torch.where(past, extra, 0.0))


class KLClampedAt8(PolicyRef):
    """Wrong: k3's value clamped at 8, not verl's 10: a token whose KL lies between them gets no
    KL gradient."""

    name: ClassVar[str] = "wrong-policy-k3-clamp"

    def terms(self, call: PolicyLossCall, lp: torch.Tensor, ent: torch.Tensor) -> TokenTerms:
        t = super().terms(call, lp, ent)
        if not call.kl_coef or call.kl_estimator != "k3":
            return t
        assert call.ref_log_probs is not None
        d = (call.ref_log_probs - lp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        k3 = torch.exp(d) - d - 1
        band = (k3 > 8) & (k3 <= KL_BOUND) & (call.token_weight != 0)
        dropped = call.kl_coef * (1 - torch.exp(d)) * call.token_weight
        return t._replace(grad_log_probs=t.grad_log_probs - torch.where(band, dropped, 0.0))


class EntropyTwiceAtLabel(PolicyRef):
    """Wrong: the label column's logit gradient counts the entropy's part twice, as a backend
    that adds ``-g_H p (log p + H)`` to ``label_logit_grad`` (which already holds it) would."""

    name: ClassVar[str] = "wrong-policy-label-entropy"

    def policy_loss(self, call: PolicyLossCall) -> PolicyLossResult:
        head = call.head
        with torch.enable_grad():
            h = head.hidden.detach().requires_grad_(True)
            w = head.weight.detach().requires_grad_(True)
            lp, ent = self.stats(head, h, w)
            t = self.terms(call, lp.detach(), ent.detach())
            # dz at the label column is d(lp) times g_lp and d(H) times g_H; adding c * z_label
            # with c = -g_H p (log p + H) counts the entropy's part there a second time.
            z = self.rows(head, h).float() @ w.float().T / head.temperature
            valid = head.labels != head.ignore_index
            z_label = z.gather(1, torch.where(valid, head.labels, 0).unsqueeze(1)).squeeze(1)
            p = torch.exp(lp.detach())
            c = -t.grad_entropy * p * (lp.detach() + ent.detach())
            twice = (torch.where(valid, c, 0.0) * z_label).sum()
            gh, gw = torch.autograd.grad(
                [lp, ent, twice], [h, w], [t.grad_log_probs, t.grad_entropy, None]
            )
        grad_h, grad_w = self.grads(call, gh, gw)
        return PolicyLossResult(lp.detach(), ent.detach(), grad_hidden=grad_h, grad_weight=grad_w)


class CleansOldLogProbs(PolicyRef):
    """Wrong: right values, after replacing the NaN old log-probs of the caller's padding rows
    with 0 in place (an unchecked call hands the tensor over as it is)."""

    name: ClassVar[str] = "wrong-policy-cleans-old"

    def policy_loss(self, call: PolicyLossCall) -> PolicyLossResult:
        if call.old_log_probs is not None:
            call.old_log_probs.nan_to_num_(0.0)
        return super().policy_loss(call)


def without_kl_gradient(estimator: str) -> type[PolicyRef]:
    """Wrong for one KL estimator: its gradients leave the KL term out (the core's loss value,
    formed from the statistics, still has it)."""

    class IgnoresKL(PolicyRef):
        name: ClassVar[str] = f"wrong-policy-kl-{estimator.replace('+', '-plus')}"

        def terms(self, call: PolicyLossCall, lp: torch.Tensor, ent: torch.Tensor) -> TokenTerms:
            if call.kl_estimator == estimator:
                call = dataclasses.replace(call, kl_coef=0.0)
            return super().terms(call, lp, ent)

    return IgnoresKL


#: Each wrong backend and the property that must fail it.
WRONG: dict[type, str] = {
    IgnoresDualClip: "policy_loss_accuracy",
    NoEntropyGradient: "policy_loss_accuracy",
    MasksByMultiplying: "policy_loss_ignored_rows",
    ReusedBuffers: "policy_loss_upstream_scale",
    ReusedWeightBuffer: "policy_loss_upstream_scale",
    NotDeterministic: "policy_loss_determinism",
    GradientsNobodyAskedFor: "policy_loss_contract",
    ZeroesIgnoredAdvantages: "policy_loss_contract",
    ReusedStatistics: "policy_loss_contract",
    RatioUnclamped: "policy_loss_accuracy",
    KLClampedAt8: "policy_loss_accuracy",
    EntropyTwiceAtLabel: "policy_loss_accuracy",
    CleansOldLogProbs: "policy_loss_contract",
}
ALL: tuple[type, ...] = (PolicyRef, Undeclared, HotPerToken, *WRONG)


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
