"""Properties of the ``policy_loss`` capability (``fused_policy_loss``), run where it is declared.

The yardstick is verl's loss over float64 full logits
(``fusedhead.reference.policy_loss_from_log_probs`` on ``reference_outputs``): its value, and the
gradients of hidden and weight through autograd. The bounds are the head's (``tolerances.py``),
carried through the loss: the loss is ``sum_i w_i l_i(lp_i, H_i)``, so its error is at most
``sum_i |dL/dlp_i| e_lp + |dL/dH_i| e_H`` (``e`` the max abs bound of each statistic) plus the fp32
rounding of the terms, and its gradients are the head's backward with upstream ``dL/dlp`` and
``dL/dH``, held to the head's gradient bound with that upstream, plus what the backend's own
statistics carry in: the derivative formed (in float64) at the log-prob and entropy it returned,
which the forward bounds let be off, against the exact one (``_Expected.carried``). Without it,
a weight-gradient row of a rarely likely token on a peaked packed batch failed on an H100 in fp32
(1.08e-7 against 1.02e-7) where the backend was right to its statistics.

The loss has kinks (the clip bounds, the dual clip): a log-prob a rounding error off moves a
token across one and its gradient jumps. The kit's log-ratios are drawn at least a margin (twice
the log-prob bound) away from every kink, so a right backend never straddles one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from fusedhead.protocol import KL_ESTIMATORS
from fusedhead.reference import policy_loss_from_log_probs
from fusedhead.testing.inputs import (
    FLAT,
    IGNORE_INDEX,
    PEAKED,
    TEMPERATURE,
    Case,
    make_case,
    poison_ignored,
)
from fusedhead.testing.outcome import NotRun, PropertyFailure
from fusedhead.testing.outputs import (
    magnitude_terms,
    magnitudes,
    reference_logits,
    reference_outputs,
)
from fusedhead.testing.target import Target
from fusedhead.testing.tolerances import UNIT_ROUNDOFF, Bound, assert_close, same_bits

Property = Callable[[Target], None]
AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
#: The penalty terms the accuracy sweep crosses with the aggregations (verl's estimator names).
PENALTIES: tuple[dict[str, Any], ...] = (
    {"entropy_coef": 0.01},
    {"kl_coef": 0.1, "kl_estimator": "k1"},
    {"kl_coef": 0.1, "kl_estimator": "k2", "entropy_coef": 0.02},
    {"kl_coef": 0.1, "kl_estimator": "k3", "entropy_coef": -0.02},
)
#: (dual clip, truncated importance sampling) settings, cycled against the penalties so that each
#: aggregation meets each setting and each penalty (a Latin square, 16 calls, not 64).
CLIPS: tuple[tuple[float | None, bool], ...] = (
    (None, False),
    (1.8, False),
    (None, True),
    (1.8, True),
)
CLIP_LOW, CLIP_HIGH, TIS_CAP = 0.2, 0.28, 1.5
#: The per-token inputs besides labels and temperature: an ignored row's may hold anything.
PER_TOKEN_TERMS = ("old_log_probs", "advantages", "ref_log_probs", "rollout_log_probs")
#: Log-ratios ``lp - old`` are drawn in this range, then moved off the kinks.
LOG_RATIO_RANGE = (-0.8, 0.9)
#: The margin never exceeds this (coarse logits): kinks are about 0.34 apart at least.
MAX_MARGIN = 0.12


def _declared(target: Target) -> None:
    if not target.caps.policy_loss:
        why = f"the backend does not declare policy_loss on {target.device.type}"
        if callable(getattr(target.head.backend, "policy_loss", None)):
            # most likely forgotten: a NOT RUN that reads as fine would hide the method from CI
            why += (
                f", although it defines a policy_loss() method: if that should run on "
                f"{target.device.type}, declare it in capabilities() "
                "(Capabilities(policy_loss=True)) to have it run and checked"
            )
        raise NotRun(why)


def _float(t: torch.Tensor | float) -> torch.Tensor | float:
    return t.double() if isinstance(t, torch.Tensor) else t


class _Batch:
    """One case's per-token RL terms (fp32 on the CPU, labels' shape), made for a target."""

    def __init__(
        self,
        target: Target,
        case: Case,
        *,
        seed: int,
        temperature: float | torch.Tensor = TEMPERATURE,
        softcap: float | None = None,
        dual_clip: float | None = None,
    ) -> None:
        self.case = case
        self.temperature = target.allowed_temperature(temperature)
        self.softcap = softcap
        dt = target.dtype
        h = case.hidden.reshape(-1, case.hidden.shape[-1]).to(dt).double()
        w = case.weight.to(dt).double()
        y = case.labels.reshape(-1)
        with torch.no_grad():
            ref = reference_outputs(h, w, y, temperature=_float(self.temperature), softcap=softcap)
            z, _ = reference_logits(h, w, _float(self.temperature), softcap)
        valid = y != IGNORE_INDEX
        zmax = float(z[valid].abs().max()) if bool(valid.any()) else 0.0
        self.tol = target.tolerances(h.shape[1], w.shape[0], zmax)
        margin = min(2 * 4 * self.tol.log_probs.scale, MAX_MARGIN)
        kinks = [math.log(1 - CLIP_LOW), math.log(1 + CLIP_HIGH)]
        if dual_clip is not None:
            kinks.append(math.log(dual_clip))
        g = torch.Generator().manual_seed(30_000 + seed)
        n = y.shape[0]
        log_ratio = torch.empty(n, dtype=torch.float64).uniform_(*LOG_RATIO_RANGE, generator=g)
        for kink in kinks:
            near = (log_ratio - kink).abs() < margin
            away = torch.where(log_ratio >= kink, 1.0, -1.0)
            log_ratio = torch.where(near, kink + away * margin, log_ratio)
        lp = ref["log_probs"]
        #: float64 log-probs of the labels (flat), the values the backend's are held to.
        self.log_probs = lp
        shape = tuple(case.labels.shape)
        self.old = (lp - log_ratio).float().reshape(shape)
        self.advantages = torch.randn(n, generator=g).reshape(shape)
        self.ref_log_probs = (lp + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)).float()
        self.ref_log_probs = self.ref_log_probs.reshape(shape)
        self.rollout = (self.old.reshape(-1) + 0.3 * torch.randn(n, generator=g)).reshape(shape)

    def kwargs(self, *, dual_clip: float | None, tis: bool, **extra: Any) -> dict[str, Any]:
        """The loss's keyword arguments on the CPU (per-token tensors fp32)."""
        kw: dict[str, Any] = {
            "old_log_probs": self.old,
            "advantages": self.advantages,
            "clip_low": CLIP_LOW,
            "clip_high": CLIP_HIGH,
            "dual_clip": dual_clip,
            **extra,
        }
        if kw.get("kl_coef"):
            kw["ref_log_probs"] = self.ref_log_probs
        if tis:
            kw["rollout_log_probs"] = self.rollout
            kw["tis_cap"] = TIS_CAP
        return kw


def _on(device: torch.device, kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


class _Expected:
    """The float64 loss, its gradients and their bounds for one call's arguments."""

    def __init__(self, batch: _Batch, target: Target, kw: dict[str, Any], upstream: float = 1.0):
        case, dt = batch.case, target.dtype
        hh = case.hidden.reshape(-1, case.hidden.shape[-1]).to(dt).double().requires_grad_(True)
        ww = case.weight.to(dt).double().requires_grad_(True)
        yy = case.labels.reshape(-1)
        temp = _float(batch.temperature)
        if isinstance(temp, torch.Tensor):
            temp = temp.expand(case.labels.shape).reshape(-1)
        ref = reference_outputs(hh, ww, yy, temperature=temp, softcap=batch.softcap)
        shape = tuple(case.labels.shape)
        lp = ref["log_probs"].detach().reshape(shape).requires_grad_(True)
        ent = ref["entropy"].detach().reshape(shape).requires_grad_(True)
        kw64: dict[str, Any] = {
            k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in kw.items()
        }
        loss = policy_loss_from_log_probs(lp, ent, case.labels, **kw64)
        g_lp, g_ent = _derivatives(loss, lp, ent)
        g_lp, g_ent = g_lp.reshape(-1) * upstream, g_ent.reshape(-1) * upstream
        torch.autograd.backward([ref["log_probs"], ref["entropy"]], [g_lp, g_ent])
        self.loss = float(loss.detach())
        assert hh.grad is not None and ww.grad is not None
        self.grad_hidden = hh.grad.reshape(case.hidden.shape)
        self.grad_weight = ww.grad
        self.log_probs = ref["log_probs"].detach().reshape(shape)
        self.entropy = ref["entropy"].detach().reshape(shape)
        tol = batch.tol
        # The loss: each statistic's max abs bound through |dL/d.|, plus the fp32 terms' rounding.
        terms = (loss.detach().abs() + (g_lp.abs() + g_ent.abs()).sum()) / abs(upstream)
        self.loss_bound = float(
            4 * tol.log_probs.scale * (g_lp.abs().sum() / abs(upstream))
            + 4 * tol.entropy.scale * (g_ent.abs().sum() / abs(upstream))
            + 16 * (yy.numel() + 8) * UNIT_ROUNDOFF["fp32"] * terms
        )
        upstreams = {"log_probs": g_lp.detach(), "entropy": g_ent.detach()}
        detached = {k: v.detach() for k, v in ref.items()}
        d = magnitude_terms(detached, upstreams, yy, {}, IGNORE_INDEX)
        slope: torch.Tensor | float = 1.0
        if batch.softcap is not None:
            th = torch.tanh(hh.detach() @ ww.detach().T / batch.softcap)
            slope = 1 - th * th
        m_h, m_w = magnitudes(d, hh.detach(), ww.detach(), slope, temp)
        self.m_hidden = m_h.reshape(case.hidden.shape)
        self.m_weight = m_w
        self._carry = (
            kw64,
            upstream,
            g_lp,
            g_ent,
            detached,
            yy,
            hh.detach(),
            ww.detach(),
            slope,
            temp,
        )
        self.grad_bound = tol.grad

    def carried(self, out: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The error the backend's own statistics carry into its gradients, per element of
        grad hidden and grad weight: each token's derivative formed (in float64) at the log-prob
        and entropy the backend returned, against the exact one, through ``|dz|``. The forward
        bounds allow those statistics their error; the gradients then carry its consequence."""
        kw64, upstream, g_lp, g_ent, detached, yy, hh, ww, slope, temp = self._carry
        shape = self.log_probs.shape
        lp = out.log_probs.detach().cpu().double().reshape(shape).requires_grad_(True)
        ent = out.entropy.detach().cpu().double().reshape(shape).requires_grad_(True)
        loss = policy_loss_from_log_probs(lp, ent, yy.reshape(shape), **kw64)
        b_lp, b_ent = _derivatives(loss, lp, ent)
        off = {
            "log_probs": (b_lp.reshape(-1) * upstream - g_lp).abs(),
            "entropy": (b_ent.reshape(-1) * upstream - g_ent).abs(),
        }
        d = magnitude_terms(detached, off, yy, {}, IGNORE_INDEX)
        e_h, e_w = magnitudes(d, hh, ww, slope, temp)
        return e_h.reshape(self.grad_hidden.shape), e_w


def _derivatives(
    loss: torch.Tensor, lp: torch.Tensor, ent: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dloss/dlp, dloss/dent)``, zeros for a statistic the loss does not use."""
    grads = torch.autograd.grad([loss], [lp, ent], allow_unused=True)
    return tuple(  # type: ignore[return-value]
        torch.zeros_like(t) if g is None else g.detach()
        for g, t in zip(grads, (lp, ent), strict=True)
    )


def _call(
    target: Target,
    batch: _Batch,
    kw: dict[str, Any],
    *,
    hidden: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    requires: tuple[bool, bool] = (True, True),
    every_row: bool = False,
    ignore_index: int | None = None,
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The backend's loss on ``batch`` (its leaves on the target), and the leaves; ``hidden`` and
    ``temperature`` replace the batch's in the call alone; ``every_row``: unchecked, so the
    backend itself sees the ignored rows (a checked call leaves them out); ``ignore_index``: the
    batch's ignored rows labelled with it, in a head of that ``ignore_index`` (unchecked)."""
    dev, dt = target.device, target.dtype
    source = batch.case.hidden if hidden is None else hidden
    h = source.detach().to(dev, dt).requires_grad_(requires[0])
    w = batch.case.weight.detach().to(dev, dt).requires_grad_(requires[1])
    temp = batch.temperature if temperature is None else temperature
    if isinstance(temp, torch.Tensor):
        temp = temp.to(dev)
    labels = batch.case.labels
    if ignore_index is not None:
        labels = labels.masked_fill(labels == IGNORE_INDEX, ignore_index)
        head = target.unchecked_head(ignore_index)
    else:
        head = target.unchecked_head() if every_row else target.head
    out = head.policy_loss(
        h,
        w,
        labels.to(dev),
        temperature=temp,
        softcap=batch.softcap,
        **_on(dev, kw),
    )
    return out, h, w


def _compare(
    label: str,
    out: Any,
    h: torch.Tensor,
    w: torch.Tensor,
    want: _Expected,
) -> None:
    """The loss and both gradients (``want`` made with the upstream backward saw)."""
    try:
        got = float(out.loss.detach())
        if not math.isfinite(got) or abs(got - want.loss) > want.loss_bound:
            raise PropertyFailure(
                f"loss {got!r}, float64 {want.loss!r}: abs err {abs(got - want.loss):.3g} > "
                f"bound {want.loss_bound:.3g}"
            )
        e_hidden, e_weight = want.carried(out)
        for leaf, t, ref, m, e in (
            ("hidden", h, want.grad_hidden, want.m_hidden, e_hidden),
            ("weight", w, want.grad_weight, want.m_weight, e_weight),
        ):
            if t.grad is None:
                raise PropertyFailure(f"grad of {leaf} is None although {leaf} requires grad")
            assert_close(f"grad {leaf}", t.grad.detach().cpu(), ref, want.grad_bound, m, e)
    except PropertyFailure as exc:
        raise PropertyFailure(f"{label}: {exc}") from None


def _statistics(label: str, out: Any, want: _Expected, batch: _Batch) -> None:
    """log_probs and entropy of the output: float64's within the head's bounds, 0 where ignored."""
    try:
        ignored = batch.case.labels == IGNORE_INDEX
        for field, bound in (("log_probs", batch.tol.log_probs), ("entropy", batch.tol.entropy)):
            t = getattr(out, field).detach().cpu()
            if bool((t[ignored] != 0).any()):
                raise PropertyFailure(f"{field} of ignored rows must be exactly 0")
            assert_close(field, t, getattr(want, field), Bound(bound.scale))
    except PropertyFailure as exc:
        raise PropertyFailure(f"{label}: {exc}") from None


def _describe(kw: dict[str, Any]) -> str:
    parts = [f"aggregation {kw.get('aggregation', 'token-mean')}"]
    if kw.get("old_log_probs", 0) is None:
        parts.append("old_log_probs None (on-policy)")
    if kw.get("dual_clip") is not None:
        parts.append(f"dual_clip {kw['dual_clip']}")
    if "tis_cap" in kw:
        parts.append(f"TIS cap {kw['tis_cap']}")
    if kw.get("entropy_coef"):
        parts.append(f"entropy_coef {kw['entropy_coef']}")
    if kw.get("kl_coef"):
        parts.append(f"kl_coef {kw['kl_coef']} {kw.get('kl_estimator', 'k3')}")
    if kw.get("cu_seqlens") is not None:
        parts.append(f"cu_seqlens {kw['cu_seqlens'].tolist()}")
    if kw.get("loss_normalizer") is not None:
        parts.append(f"loss_normalizer {kw['loss_normalizer']}")
    return ", ".join(parts)


def _check(target: Target, batch: _Batch, kw: dict[str, Any], label: str) -> None:
    """One call against float64: the loss, both gradients, the statistics."""
    label = f"{label}, {_describe(kw)}"
    try:
        out, h, w = _call(target, batch, kw)
        out.loss.backward()
    except Exception as exc:
        raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
    want = _Expected(batch, target, kw)
    _compare(label, out, h, w, want)
    _statistics(label, out, want, batch)


def policy_loss_accuracy(target: Target) -> None:
    """If declared: the policy loss and both gradients match float64 (every aggregation, dual clip, TIS, entropy, each KL estimator with k3 both sides of its clamp, log-ratios past the clamp at 20, confident labels under a large entropy bonus, packed, normalizer, horizon, on-policy, softcap saturated or not)."""
    _declared(target)
    n, h, v = target.sizes.small
    b = 4
    case = make_case(n, h, v, scale=FLAT, seed=60, lead=(b, n // b))
    case.labels[0, n // b // 2 :] = IGNORE_INDEX  # a ragged sequence
    batches = {dual: _Batch(target, case, seed=61, dual_clip=dual) for dual in (None, 1.8)}
    for i, aggregation in enumerate(AGGREGATIONS):
        for j, penalty in enumerate(PENALTIES):
            dual, tis = CLIPS[(i + j) % len(CLIPS)]
            kw = batches[dual].kwargs(dual_clip=dual, tis=tis, aggregation=aggregation, **penalty)
            _check(target, batches[dual], kw, case.description)
    # A packed batch [1, T] with cu_seqlens, peaked logits; a global normalizer.
    packed = make_case(n, h, v, scale=PEAKED, seed=62, lead=(1, n))
    batch = _Batch(target, packed, seed=63, dual_clip=1.8)
    cu = torch.tensor([0, 5, 5 + n // 3, n - 4, n])
    for aggregation in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        kw = batch.kwargs(dual_clip=1.8, tis=True, aggregation=aggregation, **PENALTIES[3])
        _check(target, batch, {**kw, "cu_seqlens": cu}, packed.description)
    kw = batch.kwargs(dual_clip=None, tis=False, **PENALTIES[0])
    _check(target, batch, {**kw, "loss_normalizer": 3.0 * n}, packed.description)
    # A fixed horizon for the norm mode (verl's loss_scale_factor), over the packed sequences.
    kw = batch.kwargs(dual_clip=None, tis=False, aggregation="seq-mean-token-sum-norm")
    _check(target, batch, {**kw, "cu_seqlens": cu, "horizon": 2.0 * n}, packed.description)
    # Every other estimator of the protocol (verl's abs, its straight-through forms: the value,
    # k2's gradient; TRL's unclamped k3) and k3 again, with references that put k3 (of
    # d = ref - lp) on both sides of its clamp of the KL at 10, kinks at d = -11.0 and 2.61:
    # d = 3 and -12 past it (no gradient), d = 2.3 and -9 below it (k3 6.7 and 8.0), where a
    # clamp at a smaller bound would drop the gradient.
    offsets = torch.tensor([0.0, 3.0, 2.3, -9.0, -12.0], dtype=torch.float64)
    d = offsets[torch.arange(n) % len(offsets)]
    far = torch.where(d == 0, batch.ref_log_probs.reshape(-1).double(), batch.log_probs + d)
    far = far.float().reshape(1, n)
    swept = {p["kl_estimator"] for p in PENALTIES if "kl_estimator" in p}
    for estimator in (*(e for e in KL_ESTIMATORS if e not in swept), "k3"):
        kw = batch.kwargs(dual_clip=None, tis=False, kl_coef=0.1, kl_estimator=estimator)
        _check(target, batch, {**kw, "ref_log_probs": far}, f"{packed.description}, {estimator}")
    _far_ratios(target, batch, packed.description)
    _confident_labels(target, n, h, v)
    # On-policy: old_log_probs None (the current policy's, ratio 1): PolicyLossCall.old_log_probs
    # is None, which fusedhead.policy_terms.token_grads reads so.
    kw = batch.kwargs(dual_clip=1.8, tis=False, aggregation="seq-mean-token-mean", **PENALTIES[3])
    _check(target, batch, {**kw, "old_log_probs": None}, packed.description)
    if target.caps.softcap:
        batch = _Batch(target, case, seed=64, softcap=5.0, temperature=1.3)
        kw = batch.kwargs(
            dual_clip=None, tis=False, aggregation="seq-mean-token-mean", **PENALTIES[1]
        )
        _check(target, batch, kw, f"{case.description}, softcap 5.0, temperature 1.3")
        # Peaked logits far past a cap of 1: the cap's derivative sech^2 is tiny there, and a
        # backend that rebuilds it as 1 - tanh^2 of a 16-bit capped logit loses every digit.
        batch = _Batch(target, packed, seed=68, softcap=1.0, temperature=1.3)
        kw = batch.kwargs(dual_clip=None, tis=False, **PENALTIES[0])
        _check(target, batch, kw, f"{packed.description}, saturating softcap 1.0")
    if target.caps.per_token_temperature:
        temps = torch.linspace(0.4, 2.0, n).reshape(b, n // b)
        batch = _Batch(target, case, seed=65, temperature=temps)
        kw = batch.kwargs(dual_clip=None, tis=True, **PENALTIES[3])
        _check(target, batch, kw, f"{case.description}, per-token temperatures 0.4 to 2")


def _far_ratios(target: Target, batch: _Batch, description: str) -> None:
    """Tokens whose log-ratio ``lp - old`` is 25 or -25 (stale or off-policy ones), past verl's
    clamp of the log-ratio to [-20, 20], whose derivative is 0 there: with a negative advantage
    and no dual clip such a token adds ``-A e^20`` to the loss and nothing to the gradients
    (without the clamp, ``-A e^25``); with the dual clip, ``-A dual_clip`` and nothing."""
    n = batch.log_probs.shape[0]
    shape = batch.old.shape
    pick = torch.arange(n) % 3
    side = torch.where(pick == 1, 25.0, torch.where(pick == 2, -25.0, 0.0)).double()
    old = torch.where(side == 0, batch.old.reshape(-1).double(), batch.log_probs - side)
    adv = batch.advantages.reshape(-1)
    adv = torch.where(side > 0, -adv.abs() - 0.5, adv)  # past the clamp from above: A < 0
    for dual in (None, 1.8):
        kw = batch.kwargs(dual_clip=dual, tis=False, **PENALTIES[0])
        kw = {**kw, "old_log_probs": old.float().reshape(shape), "advantages": adv.reshape(shape)}
        label = f"{description}, log-ratios of +25 (advantage < 0) and -25 at a third of the tokens each"
        _check(target, batch, kw, label)


def _confident_labels(target: Target, n: int, h: int, v: int) -> None:
    """Labels the model is sure of (the argmax of peaked logits) with a large entropy bonus: the
    label column's gradient holds both the log-prob's part and the entropy's, and a backend
    that counts the entropy's there twice is off by ``g_H p (log p + H)``, large where p is."""
    case = make_case(n, h, v, scale=PEAKED, seed=80, lead=(4, n // 4))
    hh = case.hidden.reshape(-1, h).to(target.dtype).double()
    logits = hh @ case.weight.to(target.dtype).double().T
    labels = logits.argmax(dim=-1).reshape(case.labels.shape)
    labels[case.labels == IGNORE_INDEX] = IGNORE_INDEX
    case = replace(case, labels=labels, description=f"{case.description}, argmax labels")
    batch = _Batch(target, case, seed=81)
    for coef in (0.5, -0.5):
        kw = batch.kwargs(dual_clip=None, tis=False, entropy_coef=coef)
        _check(target, batch, kw, case.description)


def policy_loss_ignored_rows(target: Target) -> None:
    """If declared: ignored rows (NaN/Inf hidden, NaN old/ref log-probs and advantages, any per-token temperature) add nothing, get exactly zero gradient; all rows ignored give loss 0."""
    _declared(target)
    n, h, v = target.sizes.small
    case = make_case(n, h, v, scale=FLAT, seed=66, ignore_fraction=0.3, lead=(4, n // 4))
    ignored = case.labels == IGNORE_INDEX
    dirty = case.hidden.clone()
    rows = ignored.nonzero()
    for i, (r, c) in enumerate(rows.tolist()):
        dirty[r, c, i % h] = (math.nan, math.inf, -math.inf)[i % 3]
    batches: list[tuple[_Batch, torch.Tensor | None]] = [(_Batch(target, case, seed=67), None)]
    if target.caps.per_token_temperature:
        # An unchecked call may carry any temperature on an ignored row (NaN, 0, negative).
        temps = torch.linspace(0.5, 1.5, case.labels.numel()).reshape(case.labels.shape)
        junk = torch.tensor([math.nan, 0.0, -1.0]).repeat(int(ignored.sum()) // 3 + 1)
        batch = _Batch(target, case, seed=67, temperature=temps)
        # the batch's temperatures (raised to a declared min_temperature), junk where ignored
        dirty_temps = torch.as_tensor(batch.temperature).clone()
        dirty_temps[ignored] = junk[: int(ignored.sum())]
        batches.append((batch, dirty_temps))
    # Unchecked calls hand the backend the ignored rows; a checked call leaves them out (core).
    # -1 and the vocabulary's size: an ignore_index other than -100 (a backend that compares
    # with -100 scores those rows), one a label could never equal, and a non-negative one.
    for (batch, call_temps), (aggregation, every_row, index) in itertools.product(
        batches,
        (
            ("token-mean", True, None),
            ("seq-mean-token-mean", True, None),
            ("token-mean", False, None),
            ("token-mean", True, -1),
            ("seq-mean-token-mean", True, v),
        ),
    ):
        if call_temps is not None and not every_row:
            continue  # a checked call refuses a temperature that is not > 0, ignored row or not
        kw = batch.kwargs(dual_clip=None, tis=False, aggregation=aggregation, **PENALTIES[3])
        nan_terms = {
            k: torch.where(ignored, math.nan, v) if k in PER_TOKEN_TERMS else v
            for k, v in kw.items()
        }
        label = (
            f"{case.description}, {int(ignored.sum())} ignored rows with NaN/Inf in their hidden "
            f"state and NaN old/ref log-probs and advantages"
            + (", NaN/0/-1 per-token temperatures" if call_temps is not None else "")
            + f", aggregation {aggregation}"
            + (", every row handed to the backend (check_labels=False)" if every_row else "")
            + ("" if index is None else f", ignore_index={index}")
        )
        try:
            out, hh, ww = _call(
                target,
                batch,
                nan_terms,
                hidden=dirty,
                temperature=call_temps,
                every_row=every_row,
                ignore_index=index,
            )
            out.loss.backward()
        except Exception as exc:
            raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
        try:
            assert hh.grad is not None and ww.grad is not None
            gh = hh.grad.detach().cpu()
            wrong = (gh != 0).any(dim=-1) & ignored
            if bool(wrong.any()):
                at = tuple(int(i) for i in wrong.nonzero()[0])
                raise PropertyFailure(
                    f"grad hidden of ignored rows must be exactly 0: {int(wrong.sum())} of "
                    f"{int(ignored.sum())} are not, the first at {at} (largest |value| "
                    f"{float(gh[at].abs().nan_to_num(math.inf).max()):.3g})"
                )
            if not bool(torch.isfinite(ww.grad).all()):
                raise PropertyFailure(
                    "grad weight is not finite: an ignored row's NaN/Inf hidden state reached it "
                    "(a zero derivative times NaN is NaN; select the scored rows out before the "
                    "GEMMs)"
                )
        except PropertyFailure as exc:
            raise PropertyFailure(f"{label}: {exc}") from None
        # The same loss and gradients as float64 on the clean values (ignored rows count for nothing).
        _compare(label, out, hh, ww, _Expected(batch, target, kw))
        _statistics(label, out, _Expected(batch, target, kw), batch)
    every = make_case(8, h, v, scale=FLAT, seed=68, ignore_fraction=1.0)
    batch = _Batch(target, every, seed=69)
    kw = batch.kwargs(dual_clip=None, tis=False, **PENALTIES[3])
    label = f"{every.description}, every row ignored, every row handed to the backend"
    try:
        out, hh, ww = _call(target, batch, kw, every_row=True)
        out.loss.backward()
    except Exception as exc:
        raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
    for what, t in (("loss", out.loss), ("grad hidden", hh.grad), ("grad weight", ww.grad)):
        if t is None or bool((t.detach() != 0).any()):
            raise PropertyFailure(f"{label}: {what} must be exactly 0, got {t}")


def policy_loss_upstream_scale(target: Target) -> None:
    """If declared: backward of c * loss scales both gradients by c (a GradScaler's 65536 over a global count of 2**18 included); micro-batches accumulate into .grad, a backward after each or one after both forwards (no gradient buffer reused across calls)."""
    _declared(target)
    n, h, v = target.sizes.small
    case = make_case(n, h, v, scale=FLAT, seed=70, lead=(4, n // 4))
    batch = _Batch(target, case, seed=71, dual_clip=1.8)
    kw = batch.kwargs(dual_clip=1.8, tis=True, **PENALTIES[3])
    for c in (0.25, -3.0):
        label = f"{case.description}, ({c}) * loss backward"
        try:
            out, hh, ww = _call(target, batch, kw)
            (out.loss * c).backward()
        except Exception as exc:
            raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
        _compare(label, out, hh, ww, _Expected(batch, target, kw, upstream=c))
    # A GradScaler's first scale on a token-mean over a global count far past the call's rows:
    # gradients formed in fp16 at scale 1 flush to zero before the scale could lift them.
    kw = batch.kwargs(dual_clip=None, tis=False, loss_normalizer=2.0**18, **PENALTIES[0])
    label = f"{case.description}, loss_normalizer 2**18, (65536) * loss backward"
    try:
        out, hh, ww = _call(target, batch, kw)
        (out.loss * 65536.0).backward()
    except Exception as exc:
        raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
    _compare(label, out, hh, ww, _Expected(batch, target, kw, upstream=65536.0))
    # Gradient accumulation: two micro-batches, each normalised by the global token count.
    second = replace(make_case(n, h, v, seed=72, lead=(4, n // 4)), weight=case.weight)
    other = _Batch(target, second, seed=73)
    total = float((case.labels != IGNORE_INDEX).sum() + (second.labels != IGNORE_INDEX).sum())
    kw1 = batch.kwargs(dual_clip=None, tis=False, loss_normalizer=total, **PENALTIES[0])
    kw2 = other.kwargs(dual_clip=None, tis=False, loss_normalizer=total, **PENALTIES[0])
    for together in (False, True):
        # together: both forwards before one backward, as two losses summed are (a gradient
        # buffer the backend reuses from call to call is overwritten before it is handed out)
        how = "both forwards, then one backward" if together else "a backward after each"
        label = (
            f"{case.description}: two micro-batches into one .grad ({how}), loss_normalizer "
            f"{total:g}"
        )
        _two_micro_batches(target, (batch, kw1), (other, kw2), case.weight, together, label)


def _two_micro_batches(
    target: Target,
    first: tuple[_Batch, dict[str, Any]],
    second: tuple[_Batch, dict[str, Any]],
    weight: torch.Tensor,
    together: bool,
    label: str,
) -> None:
    """Two calls on one weight, each loss times 0.5, backward after each or after both: the
    hidden gradients and the weight's accumulated one against float64."""
    dev, dt = target.device, target.dtype
    w = weight.detach().to(dev, dt).requires_grad_(True)
    head = target.unchecked_head()  # every row to the backend: its own buffers reach autograd
    try:
        hiddens, losses = [], []
        for part, kw_part in (first, second):
            hp = part.case.hidden.detach().to(dev, dt).requires_grad_(True)
            out = head.policy_loss(
                hp, w, part.case.labels.to(dev), temperature=part.temperature, **_on(dev, kw_part)
            )
            hiddens.append(hp)
            losses.append(out.loss * 0.5)
            if not together:
                torch.autograd.backward([losses.pop()])
        if together:
            torch.autograd.backward(losses)
    except Exception as exc:
        raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
    want1 = _Expected(first[0], target, first[1], upstream=0.5)
    want2 = _Expected(second[0], target, second[1], upstream=0.5)
    try:
        grads = [hp.grad for hp in hiddens if hp.grad is not None]
        if len(grads) == 2 and len({_storage(g) for g in grads}) == 1:
            raise PropertyFailure(
                "the two micro-batches' grad hidden share memory: the backend handed out one "
                "buffer twice (PolicyLossResult's gradients are fresh tensors each call)"
            )
        for i, (hp, want) in enumerate(zip(hiddens, (want1, want2), strict=True)):
            if hp.grad is None:
                raise PropertyFailure(f"grad hidden of micro-batch {i + 1} is None")
            assert_close(
                f"grad hidden of micro-batch {i + 1}",
                hp.grad.detach().cpu(),
                want.grad_hidden,
                want.grad_bound,
                want.m_hidden,
            )
        if w.grad is None:
            raise PropertyFailure("grad weight is None")
        assert_close(
            "grad weight accumulated over both micro-batches",
            w.grad.detach().cpu(),
            want1.grad_weight + want2.grad_weight,
            want1.grad_bound,
            want1.m_weight + want2.m_weight,
        )
    except PropertyFailure as exc:
        raise PropertyFailure(f"{label}: {exc}") from None


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _bitwise(what: str, a: Any, b: Any) -> None:
    if a is None or b is None:
        if (a is None) != (b is None):
            raise PropertyFailure(f"{what}: one run returned None, the other a tensor")
        return
    if a.shape != b.shape or not torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)):
        diff = (a != b).reshape(-1).nonzero()
        where = f", first at flat index {int(diff[0, 0])}" if diff.numel() else ""
        raise PropertyFailure(
            f"{what} of two identical runs not bitwise equal ({diff.shape[0]} differ{where})"
        )


def policy_loss_determinism(target: Target) -> None:
    """If policy_loss and deterministic are declared: two runs give bitwise equal loss, statistics, metrics and gradients."""
    _declared(target)
    if not target.caps.deterministic:
        raise NotRun(f"the backend does not declare deterministic on {target.device.type}")
    n, h, v = target.sizes.main
    case = make_case(n, h, v, scale=PEAKED, seed=74, lead=(8, n // 8))
    batch = _Batch(target, case, seed=75, dual_clip=1.8)
    kw = batch.kwargs(dual_clip=1.8, tis=True, aggregation="seq-mean-token-mean", **PENALTIES[3])
    runs = []
    for _ in range(2):
        try:
            out, hh, ww = _call(target, batch, kw)
            out.loss.backward()
        except Exception as exc:
            raise PropertyFailure(
                f"{case.description}: the call raised {type(exc).__name__}: {exc}"
            ) from exc
        runs.append((out, hh.grad, ww.grad))
    (a, gh_a, gw_a), (b, gh_b, gw_b) = runs
    label = f"{case.description}, {_describe(kw)}"
    try:
        _bitwise("loss", a.loss.detach(), b.loss.detach())
        for name, t in a.metrics().items():
            _bitwise(name, t, b.metrics().get(name))
        _bitwise("log_probs", a.log_probs, b.log_probs)
        _bitwise("entropy", a.entropy, b.entropy)
        _bitwise("grad hidden", gh_a, gh_b)
        _bitwise("grad weight", gw_a, gw_b)
    except PropertyFailure as exc:
        raise PropertyFailure(f"{label}: {exc}") from None


def policy_loss_contract(target: Target) -> None:
    """If declared: the output's types and shapes, gradients only where asked, none under no_grad, a second backward and create_graph refused, unchecked out-of-range labels NaN, the inputs never written, the statistics fresh each call."""
    from fusedhead.policy_output import PolicyLossOutput

    _declared(target)
    n, h, v = target.sizes.small
    b = 4
    case = make_case(n, h, v, scale=FLAT, seed=76, lead=(b, n // b))
    batch = _Batch(target, case, seed=77, dual_clip=1.8)
    shape = tuple(case.labels.shape)
    dev = target.device
    settings: list[tuple[str, dict[str, Any]]] = [
        ("no reference, no dual clip", batch.kwargs(dual_clip=None, tis=False, **PENALTIES[0])),
        ("k3 KL and dual clip", batch.kwargs(dual_clip=1.8, tis=True, **PENALTIES[3])),
    ]
    for what, kw in settings:
        label = f"{case.description}, {what}"
        try:
            out, hh, ww = _call(target, batch, kw)
        except Exception as exc:
            raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
        try:
            if not isinstance(out, PolicyLossOutput):
                raise PropertyFailure(f"returned {type(out).__name__}, not a PolicyLossOutput")
            loss = out.loss
            if loss.shape != () or loss.dtype != torch.float32 or loss.device != hh.device:
                raise PropertyFailure(
                    f"loss must be a float32 scalar on {hh.device}, got {loss.dtype} "
                    f"{tuple(loss.shape)} on {loss.device}"
                )
            if not loss.requires_grad:
                raise PropertyFailure("loss does not require grad although hidden and weight do")
            for field in ("log_probs", "entropy"):
                t = getattr(out, field)
                if t.shape != shape or t.dtype != torch.float32 or t.requires_grad:
                    raise PropertyFailure(
                        f"{field} must be detached float32 of the labels' shape {shape}, got "
                        f"{t.dtype} {tuple(t.shape)}, requires_grad={t.requires_grad}"
                    )
            for name, t in out.metrics().items():
                if t.shape != () or t.dtype != torch.float32 or t.device.type != dev.type:
                    raise PropertyFailure(
                        f"metric {name} must be a float32 scalar on {dev}, got {t.dtype} "
                        f"{tuple(t.shape)} on {t.device}"
                    )
                if t.requires_grad:
                    raise PropertyFailure(f"metric {name} must be detached")
            has_ref = "ref_log_probs" in kw
            if (out.kl is None) == has_ref:
                raise PropertyFailure(
                    f"kl must be set exactly when ref_log_probs is given ({has_ref})"
                )
            if (out.clip_fraction_lower is None) == (kw["dual_clip"] is not None):
                raise PropertyFailure("clip_fraction_lower must be set exactly with dual_clip")
            torch.autograd.backward([loss], retain_graph=True)
            try:
                torch.autograd.backward([loss])
            except RuntimeError as exc:
                if "second backward" not in str(exc):
                    raise PropertyFailure(
                        f"a second backward raised RuntimeError without saying why: {exc}"
                    ) from exc
            else:
                raise PropertyFailure("a second backward through one loss was not refused")
        except PropertyFailure as exc:
            raise PropertyFailure(f"{label}: {exc}") from None
    label = f"{case.description}, create_graph=True"
    try:
        out, hh, ww = _call(target, batch, settings[0][1])
    except Exception as exc:
        raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
    try:
        torch.autograd.grad([out.loss], [hh], create_graph=True)
    except RuntimeError as exc:
        if "create_graph" not in str(exc):
            raise PropertyFailure(f"{label}: refused without naming create_graph: {exc}") from exc
    else:
        raise PropertyFailure(f"{label}: a differentiable gradient was not refused")
    for what, requires in (("only hidden", (True, False)), ("only weight", (False, True))):
        label = f"{case.description}, {what} requires grad"
        kw = settings[1][1]
        try:
            out, hh, ww = _call(target, batch, kw, requires=requires)
            out.loss.backward()
        except Exception as exc:
            raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
        leaves = (("hidden", hh), ("weight", ww))
        for (leaf, t), asked in zip(leaves, requires, strict=True):
            if asked and t.grad is None:
                raise PropertyFailure(f"{label}: grad of {leaf} is None")
            if not asked and t.grad is not None:
                raise PropertyFailure(f"{label}: {leaf} got a gradient nobody asked for")
        want = _Expected(batch, target, kw)
        e_hidden, e_weight = want.carried(out)
        pairs = (
            (want.grad_hidden, want.m_hidden, e_hidden),
            (want.grad_weight, want.m_weight, e_weight),
        )
        for (leaf, t), (ref, m, e), asked in zip(leaves, pairs, requires, strict=True):
            if asked:
                assert t.grad is not None
                try:
                    assert_close(f"grad {leaf}", t.grad.detach().cpu(), ref, want.grad_bound, m, e)
                except PropertyFailure as exc:
                    raise PropertyFailure(f"{label}: {exc}") from None
    label = f"{case.description}, under torch.no_grad()"
    try:
        with torch.no_grad():
            out, hh, ww = _call(target, batch, settings[1][1])
    except Exception as exc:
        raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
    if out.loss.requires_grad:
        raise PropertyFailure(f"{label}: the loss requires grad")
    want = _Expected(batch, target, settings[1][1])
    if abs(float(out.loss) - want.loss) > want.loss_bound:
        raise PropertyFailure(f"{label}: loss {float(out.loss)!r}, float64 {want.loss!r}")
    _unchecked_labels(target, batch)
    _inputs_unchanged(target)
    _fresh_statistics(target)


def _fresh_statistics(target: Target) -> None:
    """Each call's log-probs and entropy are its own: a later call leaves them as they were.
    Every row scored, checked and unchecked: then the core hands the backend's tensors on as
    they are, and a buffer it reused would give an earlier micro-batch another's values."""
    n, h, v = target.sizes.small
    for every_row in (False, True):
        kept: list[tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        for seed in (78, 79):
            case = make_case(n, h, v, scale=FLAT, seed=seed, ignore_fraction=0.0)
            batch = _Batch(target, case, seed=seed)
            label = f"{case.description}{', unchecked' if every_row else ''}"
            kw = batch.kwargs(dual_clip=None, tis=False, **PENALTIES[0])
            try:
                out, _, _ = _call(target, batch, kw, every_row=every_row)
            except Exception as exc:
                raise PropertyFailure(
                    f"{label}: the call raised {type(exc).__name__}: {exc}"
                ) from exc
            stats = {"log_probs": out.log_probs, "entropy": out.entropy}
            for earlier, then, values in kept:
                for k, t in then.items():
                    if not torch.equal(t, values[k]):
                        raise PropertyFailure(
                            f"{earlier}: its {k} changed when a later call ran ({label}): "
                            "PolicyLossResult's statistics are fresh tensors each call, never a "
                            "buffer the backend reuses"
                        )
            kept.append((label, stats, {k: t.clone() for k, t in stats.items()}))


def _inputs_unchanged(target: Target) -> None:
    """Every tensor the call reads (hidden with NaN/Inf padding rows, weight, labels, per-token
    temperature, advantages and the three log-probs) is left as it was, forward and backward:
    an unchecked call hands the backend the caller's own tensors."""
    n, h, v = target.sizes.small
    dev, dt = target.device, target.dtype
    case = make_case(n, h, v, scale=FLAT, seed=78, ignore_fraction=0.3, lead=(4, n // 4))
    temps: float | torch.Tensor = TEMPERATURE
    if target.caps.per_token_temperature:
        temps = torch.linspace(0.5, 1.5, n).reshape(case.labels.shape)
    batch = _Batch(target, case, seed=79, dual_clip=1.8, temperature=temps)
    kw = _on(dev, batch.kwargs(dual_clip=1.8, tis=True, **PENALTIES[3]))
    # Padding's values at the ignored rows of every per-token input: NaN, +Inf, -Inf in turn.
    ignored = (case.labels == IGNORE_INDEX).to(dev)
    junk = torch.tensor([math.nan, math.inf, -math.inf], device=dev)
    junk = junk.repeat(case.labels.numel() // 3 + 1)[: case.labels.numel()]
    junk = junk.reshape(case.labels.shape)
    tensors = {
        k: torch.where(ignored, junk, t) if t.shape == case.labels.shape else t
        for k, t in kw.items()
        if isinstance(t, torch.Tensor)
    }
    tensors["hidden"] = poison_ignored(case).hidden.to(dev, dt).requires_grad_()
    tensors["weight"] = case.weight.to(dev, dt).requires_grad_()
    tensors["labels"] = case.labels.to(dev)
    if isinstance(batch.temperature, torch.Tensor):
        tensors["temperature"] = batch.temperature.to(dev)
    before = {k: t.detach().clone() for k, t in tensors.items()}
    label = (
        f"{case.description}, NaN/+Inf/-Inf hidden states and per-token inputs at the ignored "
        "rows, check_labels=False"
    )
    try:
        out = target.unchecked_head().policy_loss(
            tensors["hidden"],
            tensors["weight"],
            tensors["labels"],
            temperature=tensors.get("temperature", batch.temperature),
            **{k: tensors.get(k, a) for k, a in kw.items()},
        )
        torch.autograd.backward([out.loss])
    except Exception as exc:
        raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
    for name, old in before.items():
        if not same_bits(tensors[name].detach(), old):
            raise PropertyFailure(
                f"{label}: the call wrote the caller's {name}; a backend reads its inputs, never "
                "writes them (clone what it must change)"
            )


def _unchecked_labels(target: Target, batch: _Batch) -> None:
    """An unchecked call's out-of-range labels (the contract's ``unchecked_labels``): no crash,
    NaN log-probs at their rows alone, and a NaN loss, on-policy too (never a finite one)."""
    dev = target.device
    labels = batch.case.labels.clone()
    flat = labels.view(-1)
    v = batch.case.weight.shape[0]
    bad = torch.zeros(flat.shape[0], dtype=torch.bool)
    bad[[1, 4]] = True
    flat[1], flat[4] = v, -5
    for what, old in (("off-policy", batch.old), ("on-policy", None)):
        label = f"{batch.case.description}, labels {v} and -5 at rows 1 and 4, check_labels=False, {what}"
        kw = {**batch.kwargs(dual_clip=None, tis=False, **PENALTIES[3]), "old_log_probs": old}
        h = batch.case.hidden.detach().to(dev, target.dtype).requires_grad_()
        w = batch.case.weight.detach().to(dev, target.dtype).requires_grad_()
        try:
            out = target.unchecked_head().policy_loss(
                h, w, labels.to(dev), temperature=batch.temperature, **_on(dev, kw)
            )
            torch.autograd.backward([out.loss])
        except Exception as exc:
            raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
        lp = out.log_probs.detach().cpu().reshape(-1)
        scored = (flat != IGNORE_INDEX) & ~bad
        if not bool(torch.isnan(lp[bad]).all()) or not bool(torch.isfinite(lp[scored]).all()):
            raise PropertyFailure(
                f"{label}: log_probs must be NaN at the out-of-range rows alone, got "
                f"{lp[bad].tolist()} there and {int((~torch.isfinite(lp[scored])).sum())} "
                "non-finite elsewhere"
            )
        if not bool(torch.isnan(out.loss.detach())):
            raise PropertyFailure(f"{label}: the loss must be NaN, got {float(out.loss)!r}")


POLICY_PROPERTIES: dict[str, Property] = {
    "policy_loss_accuracy": policy_loss_accuracy,
    "policy_loss_ignored_rows": policy_loss_ignored_rows,
    "policy_loss_upstream_scale": policy_loss_upstream_scale,
    "policy_loss_determinism": policy_loss_determinism,
    "policy_loss_contract": policy_loss_contract,
}
