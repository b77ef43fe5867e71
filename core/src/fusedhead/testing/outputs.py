"""Properties of the outputs past (log_probs, entropy), each run only where the backend declares it.

Top-k, argmax, gather, log-sum-exp, sum of squared probabilities and the KL of two heads, against
float64 full logits: values, gradients, ties (by the lower id), ignored rows, odd shapes, and
batch invariance where declared. The yardstick is autograd through ``[N, V]`` float64 logits;
gradient tolerances scale with the same "every term made positive" magnitude the core properties
use (``tolerances.py``).

Ranking: the integer-valued case makes every logit exact in every dtype (ties included), so ids
must match the float64 ranking exactly, equal logits by the lower id. On random inputs a coarser
dtype may order two logits closer than its rounding either way, so there each returned id must
be a true top-k id within the log-prob tolerance, in non-increasing order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from fusedhead.testing.inputs import (
    FLAT,
    IGNORE_INDEX,
    PEAKED,
    TEMPERATURE,
    Case,
    make_case,
    poison_ignored,
)
from fusedhead.testing.interpreter import unless_interpreter_dot_varies
from fusedhead.testing.measure import declared_temperature
from fusedhead.testing.outcome import NotRun, PropertyFailure
from fusedhead.testing.target import Target
from fusedhead.testing.tolerances import Bound, Tolerances, assert_close

Property = Callable[[Target], None]
#: Float outputs a loss may go through, and their field on ``FusedHeadOutput``.
FLOAT_FIELDS = ("log_probs", "entropy", "lse", "sum_p2", "topk_log_probs", "gathered")
#: Fields with a last dimension (k or K).
_WIDE = frozenset({"topk_ids", "topk_log_probs", "gathered"})


def _declared(target: Target, *outputs: str) -> None:
    missing = [o for o in outputs if o not in target.caps.outputs]
    if missing:
        raise NotRun(f"the backend does not declare the outputs {missing}")


def _request(
    target: Target, outputs: tuple[str, ...], k: int, ids: torch.Tensor | None
) -> dict[str, Any]:
    """Keyword arguments of a call that asks for ``outputs``."""
    kw: dict[str, Any] = {}
    if "topk" in outputs or "argmax" in outputs:
        if "topk" in outputs:
            kw["top_k"] = k
        if "argmax" in outputs:
            kw["return_argmax"] = True
    if "gather" in outputs:
        kw["gather_ids"] = ids
    if "lse" in outputs:
        kw["return_lse"] = True
    if "sum_p2" in outputs:
        kw["return_sum_p2"] = True
    return kw


def reference_logits(
    h: torch.Tensor,
    w: torch.Tensor,
    temperature: float | torch.Tensor,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """float64 scaled logits ``[N, V]`` of 2-D ``h`` and the softcap slope (for magnitudes)."""
    raw = h.double() @ w.double().T
    slope: torch.Tensor | float = 1.0
    if softcap is not None:
        th = torch.tanh(raw / softcap)
        raw, slope = softcap * th, 1 - th * th
    if isinstance(temperature, torch.Tensor):
        return raw / temperature.double().reshape(-1, 1).to(raw.device), slope
    return raw / temperature, slope


def reference_outputs(
    h: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    ignore_index: int = IGNORE_INDEX,
    topk_ids: torch.Tensor | None = None,
    gather_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """float64 outputs of 2-D ``h`` from full logits; ``topk_log_probs`` at the given ``topk_ids``."""
    z, _ = reference_logits(h, w, temperature, softcap)
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    valid = (y != ignore_index).unsqueeze(1)
    zero = torch.zeros((), dtype=torch.float64, device=z.device)

    def at(ids: torch.Tensor, drop_ignore_index: bool = True) -> torch.Tensor:
        counted = valid & (ids != ignore_index) if drop_ignore_index else valid.expand_as(ids)
        got = logp.gather(1, torch.where(counted, ids, 0).clamp(min=0))
        return torch.where(counted, got, zero)

    out = {
        "log_probs": at(y.unsqueeze(1)).squeeze(1),
        "entropy": torch.where(valid.squeeze(1), -(p * logp).sum(-1), zero),
        "lse": torch.where(valid.squeeze(1), torch.logsumexp(z, dim=-1), zero),
        "sum_p2": torch.where(valid.squeeze(1), (p * p).sum(-1), zero),
        "p": p,
        "logp": logp,
    }
    if topk_ids is not None:
        out["topk_log_probs"] = at(topk_ids, False)  # a top-k id may be ignore_index's id
    if gather_ids is not None:
        out["gathered"] = at(gather_ids)
    return out


def magnitude_terms(
    ref: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    y: torch.Tensor,
    ids: dict[str, torch.Tensor],
    ignore_index: int,
) -> torch.Tensor:
    """``|dLoss/dz|`` with every term made positive, ``[N, V]`` float64, zero on ignored rows."""
    p, logp = ref["p"].detach(), ref["logp"].detach()
    d = torch.zeros_like(p)
    valid = y != ignore_index

    def sparse(where: torch.Tensor, g: torch.Tensor) -> None:
        counted = valid.unsqueeze(1) & (where != ignore_index)
        d.scatter_add_(1, torch.where(counted, where, 0).clamp(min=0), g.abs() * counted)
        d.add_((g.abs() * counted).sum(1, keepdim=True) * p)

    for name, g in grads.items():
        g = g.double().to(p.device)
        if name == "log_probs":
            sparse(y.unsqueeze(1), g.unsqueeze(1))
        elif name == "entropy":
            ent = ref["entropy"].detach().unsqueeze(1)
            d += g.abs().unsqueeze(1) * p * (1 + logp.abs() + ent)
        elif name == "lse":
            d += g.abs().unsqueeze(1) * p
        elif name == "sum_p2":
            d += 2 * g.abs().unsqueeze(1) * p * (p + ref["sum_p2"].detach().unsqueeze(1))
        else:
            sparse(ids[name], g)
    d[~valid] = 0.0
    return d


def magnitudes(
    d: torch.Tensor, h: torch.Tensor, w: torch.Tensor, slope: torch.Tensor | float, temperature: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D' @ |W|, D'.T @ |h|)`` with ``D' = D * softcap' / T``."""
    t = (
        temperature.double().reshape(-1, 1).to(d.device)
        if isinstance(temperature, torch.Tensor)
        else temperature
    )
    dd = d * slope / t
    return dd @ w.double().abs(), dd.T @ h.double().abs()


def _zmax(z: torch.Tensor, valid: torch.Tensor) -> float:
    return float(z[valid].abs().max()) if bool(valid.any()) else 0.0


def _upstream(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(20_000 + seed)
    return torch.randn(shape, generator=g)


def check_outputs(
    target: Target,
    case: Case,
    outputs: tuple[str, ...],
    *,
    label: str,
    k: int = 8,
    gather_ids: torch.Tensor | None = None,
    temperature: float | torch.Tensor = TEMPERATURE,
    softcap: float | None = None,
    loss: tuple[str, ...] | None = None,
    exact_ranking: bool = False,
    poison: bool = False,
) -> dict[str, torch.Tensor | None]:
    """Call the backend for ``outputs`` on ``case`` and compare everything with float64.

    ``loss`` names the float outputs a random upstream gradient goes through (default: every
    float output requested); ``exact_ranking`` demands the float64 ids themselves; ``poison``
    calls the backend with NaN/+-Inf hidden states at the ignored rows (``poison_ignored``),
    against float64 on the clean case.
    """
    dev, dt = target.device, target.dtype
    temperature, label = declared_temperature(target, temperature, label)
    called = poison_ignored(case) if poison else case
    h = called.hidden.detach().to(dev, dt).requires_grad_(True)
    w = case.weight.detach().to(dev, dt).requires_grad_(True)
    y = case.labels.to(dev)
    ids = None if gather_ids is None else gather_ids.to(dev)
    if isinstance(temperature, torch.Tensor):  # per-token: the inputs' device, like the rest
        temperature = temperature.to(dev)
    kw = _request(target, outputs, k, ids)
    try:
        out = target(h, w, y, temperature=temperature, softcap=softcap, **kw)
    except Exception as exc:
        raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
    got: dict[str, torch.Tensor | None] = {
        f: getattr(out, f, None)
        for f in (
            "log_probs",
            "entropy",
            "lse",
            "sum_p2",
            "argmax",
            "topk_ids",
            "topk_log_probs",
            "gathered",
        )
    }
    lead = tuple(case.labels.shape)
    for name, field, width in (
        ("topk", "topk_ids", k),
        ("topk", "topk_log_probs", k),
        ("gather", "gathered", None if ids is None else ids.shape[-1]),
        ("argmax", "argmax", None),
        ("lse", "lse", None),
        ("sum_p2", "sum_p2", None),
    ):
        if name not in outputs:
            continue
        t = got[field]
        shape = lead if width is None else (*lead, width)
        if t is None or tuple(t.shape) != shape:
            raise PropertyFailure(
                f"{label}: {field} must have shape {shape}, got "
                f"{None if t is None else tuple(t.shape)}"
            )
    # Flatten to rows for the comparison.
    hh = case.hidden.reshape(-1, case.hidden.shape[-1]).to(dt).double()
    ww = case.weight.to(dt).double()
    yy = case.labels.reshape(-1)
    temp = (
        temperature.expand(case.labels.shape).reshape(-1)
        if isinstance(temperature, torch.Tensor)
        else temperature
    )
    flat: dict[str, torch.Tensor | None] = {}
    for f, t in got.items():
        rows = None if t is None else t.detach().cpu().reshape(yy.shape[0], -1)
        flat[f] = rows if rows is None or f in _WIDE else rows.squeeze(1)
    valid = yy != IGNORE_INDEX
    z, slope = reference_logits(
        hh, ww, temp.cpu() if isinstance(temp, torch.Tensor) else temp, softcap
    )
    zmax = _zmax(z, valid)
    tol: Tolerances = target.tolerances(hh.shape[1], ww.shape[0], zmax)
    lp_bound = tol.log_probs
    gid = None if ids is None else ids.cpu().reshape(yy.shape[0], -1)
    topk_ids = flat["topk_ids"]
    argmax = flat["argmax"]
    try:
        if topk_ids is not None:
            _check_ranking("topk_ids", topk_ids, z, valid, k, lp_bound, exact_ranking)
        if argmax is not None:
            _check_ranking("argmax", argmax.unsqueeze(1), z, valid, 1, lp_bound, exact_ranking)
            if topk_ids is not None and not torch.equal(argmax[valid], topk_ids[valid, 0]):
                raise PropertyFailure("argmax differs from the first top-k id")
    except PropertyFailure as exc:
        raise PropertyFailure(f"{label}: {exc}") from None

    hd = hh.clone().requires_grad_(True)
    wd = ww.clone().requires_grad_(True)
    ref = reference_outputs(
        hd,
        wd,
        yy,
        temperature=temp.cpu() if isinstance(temp, torch.Tensor) else temp,
        softcap=softcap,
        topk_ids=None if topk_ids is None else torch.where(valid.unsqueeze(1), topk_ids, 0),
        gather_ids=gid,
    )
    bounds = {
        "log_probs": lp_bound,
        "entropy": tol.entropy,
        "lse": lp_bound,
        "sum_p2": Bound(2 * lp_bound.scale),
        "topk_log_probs": lp_bound,
        "gathered": lp_bound,
    }
    try:
        for field in FLOAT_FIELDS:
            t = flat.get(field)
            if t is None:
                continue
            r = ref[field].detach()
            if field == "sum_p2":  # |d sum p^2| <= 2 sum p^2 |d log p|: relative to the value
                bounds[field] = Bound(
                    2 * lp_bound.scale * float(r.abs().max()) if r.numel() else 0.0
                )
            ignored = t[~valid]
            if ignored.numel() and bool((ignored != 0).any()):
                raise PropertyFailure(f"{field} of ignored rows must be exactly 0")
            assert_close(field, t, r, bounds[field])
        if topk_ids is not None and bool((topk_ids[~valid] != -1).any()):
            raise PropertyFailure("topk_ids of ignored rows must be -1")
        if argmax is not None and bool((argmax[~valid] != -1).any()):
            raise PropertyFailure("argmax of ignored rows must be -1")
    except PropertyFailure as exc:
        raise PropertyFailure(f"{label}: {exc}") from None

    through = [f for f in (loss if loss is not None else FLOAT_FIELDS) if got.get(f) is not None]
    if not through:
        return got
    outs = {f: t for f in through if (t := got[f]) is not None}
    grads = {f: _upstream(tuple(t.shape), i) for i, (f, t) in enumerate(outs.items())}
    total = torch.zeros((), dtype=torch.float64, device=dev)
    want = torch.zeros((), dtype=torch.float64)
    for f, t in outs.items():
        total = total + (t.double() * grads[f].to(dev, torch.float64)).sum()
        want = want + (ref[f] * grads[f].reshape(ref[f].shape).double()).sum()
    torch.autograd.backward([total])
    torch.autograd.backward([want])
    flat_grads = {f: g.reshape(ref[f].shape) for f, g in grads.items()}
    sparse_ids = {
        "gathered": gid,
        "topk_log_probs": None
        if topk_ids is None
        else torch.where(valid.unsqueeze(1), topk_ids, 0),
    }
    d = magnitude_terms(
        ref, flat_grads, yy, {k_: v for k_, v in sparse_ids.items() if v is not None}, IGNORE_INDEX
    )
    m_h, m_w = magnitudes(d, hh, ww, slope, temp.cpu() if isinstance(temp, torch.Tensor) else temp)
    try:
        pairs = (("hidden", h.grad, hd.grad, m_h), ("weight", w.grad, wd.grad, m_w))
        for leaf, g_leaf, r_leaf, m in pairs:
            if g_leaf is None:
                raise PropertyFailure(f"grad of {leaf} is None although {leaf} requires grad")
            assert r_leaf is not None
            assert_close(
                f"grad {leaf}", g_leaf.detach().cpu().reshape(r_leaf.shape), r_leaf, tol.grad, m
            )
        gh = h.grad.detach().cpu().reshape(hh.shape)  # type: ignore[union-attr]
        if bool((gh[~valid] != 0).any()):
            raise PropertyFailure("grad hidden of ignored rows must be exactly 0")
    except PropertyFailure as exc:
        raise PropertyFailure(
            f"{label}, upstream gradient through {', '.join(through)}: {exc}"
        ) from None
    return got


def _check_ranking(
    what: str,
    ids: torch.Tensor,
    z: torch.Tensor,
    valid: torch.Tensor,
    k: int,
    bound: Bound,
    exact: bool,
) -> None:
    """``ids [N, k]`` against the float64 ranking of ``z``: exactly, or up to the log-prob bound."""
    ranked = torch.sort(z, dim=1, descending=True, stable=True)  # equal values: lower id first
    want_ids = ranked.indices[:, :k]
    got = ids[valid]
    if got.numel() and (bool((got < 0).any()) or bool((got >= z.shape[1]).any())):
        raise PropertyFailure(f"{what} holds ids outside [0, {z.shape[1]}) on scored rows")
    if exact:
        if not torch.equal(got, want_ids[valid]):
            bad = (got != want_ids[valid]).any(1).nonzero()[0, 0]
            row = int(valid.nonzero()[bad, 0])
            raise PropertyFailure(
                f"{what} of row {row} is {ids[row].tolist()}, expected {want_ids[row].tolist()} "
                "(the float64 ranking, equal logits by the lower id)"
            )
        return
    if got.numel() and bool((got.sort(1).values[:, 1:] == got.sort(1).values[:, :-1]).any()):
        raise PropertyFailure(f"{what} repeats an id within a row")
    lse = torch.logsumexp(z, dim=1, keepdim=True)
    at_got = (z.gather(1, ids.clamp(min=0)) - lse)[valid]
    best = (ranked.values[:, :k] - lse)[valid]
    allowed = 4 * bound.scale * 2
    gap = (at_got - best).abs()
    if gap.numel() and float(gap.max()) > allowed:
        i = int(gap.max(1).values.argmax())
        raise PropertyFailure(
            f"{what}: a returned id's log-prob is {float(gap.max()):.3g} from the float64 top-{k} "
            f"value of its rank (bound {allowed:.3g}), scored row {i}"
        )


def integer_case(n: int, h: int, v: int, seed: int) -> Case:
    """Logits that are small integers in every dtype (many exact ties); duplicated weight rows."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-2, 3, (n, h), generator=g).float()
    weight = torch.randint(-1, 2, (v, h), generator=g).float()
    weight[v // 2 :: 7] = weight[3]  # the same logit at many ids, across blocks
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.randperm(n, generator=g)[: n // 10]] = IGNORE_INDEX
    return Case(hidden, weight, labels, f"integer logits N={n} H={h} V={v}")


def _gather_ids(case: Case, kk: int, seed: int) -> torch.Tensor:
    """Random ids ``[..., K]``: the label first, a repeat, and one ``ignore_index`` entry per row."""
    n, _, v = case.shape
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, v, (n, kk), generator=g)
    ids[:, 0] = case.labels.reshape(-1).clamp(min=0)
    if kk > 2:
        ids[:, 1] = ids[:, 2]
    if kk > 3:
        ids[:, -1] = IGNORE_INDEX
    return ids.reshape(*case.labels.shape, kk)


def topk_accuracy(target: Target) -> None:
    """If declared: top-k ids (exact on integer logits, ties by the lower id) and log-probs match float64."""
    _declared(target, "topk")
    n, h, v = target.sizes.main
    big = min(64, target.caps.max_top_k)
    exact = integer_case(n, 16, v, seed=31)
    for k in sorted({1, min(8, big), big}):
        check_outputs(
            target,
            exact,
            ("topk",),
            label=f"{exact.description}, top_k={k}",
            k=k,
            exact_ranking=True,
            temperature=1.0,
        )
    for scale in (FLAT, PEAKED):
        case = make_case(n, h, v, scale=scale, seed=32)
        check_outputs(target, case, ("topk",), label=f"{case.description}, top_k={big}", k=big)


def argmax_accuracy(target: Target) -> None:
    """If declared: the argmax is the float64 argmax (ties by the lower id), -1 on ignored rows."""
    _declared(target, "argmax")
    n, h, v = target.sizes.main
    exact = integer_case(n, 16, v, seed=33)
    check_outputs(
        target, exact, ("argmax",), label=exact.description, exact_ranking=True, temperature=1.0
    )
    case = make_case(n, h, v, scale=PEAKED, seed=34)
    check_outputs(target, case, ("argmax",), label=case.description)


def gather_accuracy(target: Target) -> None:
    """If declared: log-probs at given ids match float64 with gradients; K = 1 at the labels is log_probs bitwise."""
    _declared(target, "gather")
    n, h, v = target.sizes.main
    for scale in (FLAT, PEAKED):
        case = make_case(n, h, v, scale=scale, seed=35)
        got = check_outputs(
            target,
            case,
            ("gather",),
            label=f"{case.description}, K=37",
            gather_ids=_gather_ids(case, 37, 36),
        )
        assert got["gathered"] is not None
    case = make_case(n, h, v, scale=FLAT, seed=37)
    kk = 256 if target.device.type != "cpu" else 64
    check_outputs(
        target,
        case,
        ("gather",),
        label=f"{case.description}, K={kk}",
        gather_ids=_gather_ids(case, kk, 38),
        loss=("gathered",),
    )
    _gather_is_label_log_prob(target, case, softcap=None, temperature=TEMPERATURE)
    if target.caps.softcap:
        _gather_is_label_log_prob(target, case, softcap=5.0, temperature=1.3)
    if target.caps.per_token_temperature:
        temps = torch.linspace(0.3, 3.0, case.labels.numel())
        _gather_is_label_log_prob(target, case, softcap=None, temperature=temps)


def _gather_is_label_log_prob(
    target: Target, case: Case, *, softcap: float | None, temperature: float | torch.Tensor
) -> None:
    dev, dt = target.device, target.dtype
    h, w, y = case.hidden.to(dev, dt), case.weight.to(dev, dt), case.labels.to(dev)
    temperature = target.allowed_temperature(temperature)
    temp = temperature.to(dev) if isinstance(temperature, torch.Tensor) else temperature
    ids = torch.where(y == IGNORE_INDEX, 0, y).unsqueeze(-1)
    with torch.no_grad():
        out = target(h, w, y, temperature=temp, softcap=softcap, gather_ids=ids)
        plain = target(h, w, y, temperature=temp, softcap=softcap)
    what = f"{case.description}, softcap {softcap}, {'per-token temperature' if isinstance(temp, torch.Tensor) else f'temperature {temp}'}"
    for name, lp in (
        ("the same call", out.log_probs),
        ("a call without gather_ids", plain.log_probs),
    ):
        g = out.gathered[..., 0]
        if not torch.equal(torch.nan_to_num(g), torch.nan_to_num(lp)):
            diff = (g != lp).reshape(-1).nonzero()
            i = int(diff[0, 0])
            raise PropertyFailure(
                f"{what}: gathered at K=1 on the labels must be bitwise the log_probs of {name}; "
                f"{diff.shape[0]} row(s) differ, first row {i}: {g.reshape(-1)[i].item()!r} vs "
                f"{lp.reshape(-1)[i].item()!r}"
            )


def lse_and_sum_p2(target: Target) -> None:
    """If declared: the log-sum-exp and the sum of squared probabilities match float64, with gradients."""
    wanted = tuple(o for o in ("lse", "sum_p2") if o in target.caps.outputs)
    if not wanted:
        raise NotRun("the backend does not declare the outputs ['lse', 'sum_p2']")
    n, h, v = target.sizes.main
    for scale, temp in ((FLAT, TEMPERATURE), (PEAKED, 0.3), (FLAT, 5.0)):
        case = make_case(n, h, v, scale=scale, seed=39)
        check_outputs(
            target, case, wanted, label=f"{case.description}, temperature {temp}", temperature=temp
        )
    if target.caps.softcap:
        case = make_case(n, h, v, scale=PEAKED, seed=40)
        check_outputs(target, case, wanted, label=f"{case.description}, softcap 5", softcap=5.0)


def extras_together(target: Target) -> None:
    """Every declared extra in one call, with entropy, 3-D shapes, odd sizes and ignored rows (NaN/+-Inf hidden there reaching nothing): values and gradients."""
    wanted = tuple(
        o for o in ("lse", "sum_p2", "argmax", "topk", "gather") if o in target.caps.outputs
    )
    if not wanted:
        raise NotRun(
            "the backend does not declare any of the outputs lse, sum_p2, argmax, topk, gather"
        )
    k = min(5, target.caps.max_top_k) if "topk" in wanted else 0
    for n, h, v in target.sizes.odd:
        case = make_case(n, h, v, scale=FLAT, seed=41, ignore_fraction=0.3)
        kk = min(k, v)
        check_outputs(
            target,
            case,
            wanted,
            label=f"{poison_ignored(case).description}, all of {list(wanted)}",
            k=kk or 1,
            gather_ids=_gather_ids(case, 9, 42),
            poison=True,
        )
    n, h, v = target.sizes.small
    b = 4
    case = make_case(n, h, v, scale=PEAKED, seed=43, lead=(b, n // b))
    temps: float | torch.Tensor = TEMPERATURE
    if target.caps.per_token_temperature:
        temps = torch.tensor([0.5, 1.0, 2.0, 0.7]).reshape(b, 1).expand(b, n // b).contiguous()
    check_outputs(
        target,
        case,
        wanted,
        label=f"{case.description}, 3-D, all of {list(wanted)}",
        k=k or 1,
        gather_ids=_gather_ids(case, 6, 44),
        temperature=temps,
    )


@unless_interpreter_dot_varies
def batch_invariant_extras(target: Target) -> None:
    """If batch_invariant is declared: each declared extra of a row is bitwise the same alone and in a larger batch."""
    if not target.caps.batch_invariant:
        raise NotRun(f"the backend does not declare batch_invariant on {target.device.type}")
    wanted = tuple(
        o for o in ("lse", "sum_p2", "argmax", "topk", "gather") if o in target.caps.outputs
    )
    if not wanted:
        raise NotRun(
            "the backend does not declare any of the outputs lse, sum_p2, argmax, topk, gather"
        )
    n, h, v = target.sizes.main
    case = make_case(n, h, v, scale=FLAT, seed=45)
    dev, dt = target.device, target.dtype
    hid, w, y = case.hidden.to(dev, dt), case.weight.to(dev, dt), case.labels.to(dev)
    ids = _gather_ids(case, 7, 46).to(dev)
    kw = _request(target, wanted, min(8, target.caps.max_top_k), ids)
    temp = target.allowed_temperature(TEMPERATURE)
    with torch.no_grad():
        full = target(hid, w, y, temperature=temp, **kw)
        for rows in (torch.tensor([0]), torch.tensor([n - 1]), torch.arange(3, n // 2)):
            rows = rows.to(dev)
            kw_rows = {**kw, **({"gather_ids": ids[rows]} if "gather_ids" in kw else {})}
            part = target(hid[rows], w, y[rows], temperature=temp, **kw_rows)
            for field in ("lse", "sum_p2", "argmax", "topk_ids", "topk_log_probs", "gathered"):
                a, b = getattr(part, field), getattr(full, field)
                if a is None or b is None:
                    continue
                if not torch.equal(torch.nan_to_num(a), torch.nan_to_num(b[rows])):
                    raise PropertyFailure(
                        f"{case.description}: {field} of rows {rows[0].item()}..{rows[-1].item()} "
                        "alone is not bitwise the full batch's"
                    )


def _kl_reference(
    hs: torch.Tensor,
    ws: torch.Tensor,
    ht: torch.Tensor,
    wt: torch.Tensor,
    valid: torch.Tensor,
    ts: Any,
    tt: Any,
    direction: str,
    caps: tuple[float | None, float | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 per-row KL and both heads' ``p`` (for the magnitudes); ``caps``: each head's softcap."""
    zs, _ = reference_logits(hs, ws, ts, caps[0])
    zt, _ = reference_logits(ht, wt, tt, caps[1])
    ls, lt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    if direction == "forward":
        kl = (lt.exp() * (lt - ls)).sum(-1)
    else:
        kl = (ls.exp() * (ls - lt)).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, kl, zero), ls.exp(), lt.exp()


def kl_accuracy(target: Target) -> None:
    """If declared: KL(p_t || p_s) and KL(p_s || p_t) of two heads match float64 (each head's softcap too, where declared; NaN/+-Inf hidden at ignored rows reaching nothing); student gradients, none to the teacher."""
    directions = target.caps.kl_directions
    if not directions:
        raise NotRun("the backend does not declare kl_directions")
    n, h, v = target.sizes.main
    settings: list[tuple[str, int, int, float, float, Any]] = [
        ("flat", n, h, 1.0, 1.0, None),
        ("peaked", n, h, 0.7, 1.5, None),
        ("odd", *target.sizes.odd[0][:2], 1.3, 0.6, target.sizes.odd[0][2]),
    ]
    for direction in directions:
        for name, rows, hidden, t_s, t_t, odd_v in settings:
            vv = odd_v or v
            case = make_case(rows, hidden, vv, scale=PEAKED if name == "peaked" else FLAT, seed=47)
            teacher = make_case(rows, hidden // 2 + 1, vv, scale=PEAKED, seed=48)
            _check_kl(
                target,
                case,
                teacher,
                direction,
                t_s,
                t_t,
                f"{direction} KL, {case.description}, teacher H={hidden // 2 + 1}, T_s={t_s}, T_t={t_t}",
                poison=name == "odd",
            )
    if target.caps.softcap:
        case = make_case(n, h, v, scale=PEAKED, seed=52)
        teacher = make_case(n, h // 2 + 1, v, scale=PEAKED, seed=53)
        for direction in directions:
            for caps in ((5.0, 3.0), (None, 2.0), (2.5, None)):
                _check_kl(
                    target,
                    case,
                    teacher,
                    direction,
                    0.8,
                    1.2,
                    f"{direction} KL, {case.description}, softcap {caps[0]}, teacher softcap "
                    f"{caps[1]}, T_s=0.8, T_t=1.2",
                    caps,
                )
    if target.caps.per_token_temperature:
        rows, hidden, vv = target.sizes.small
        case = make_case(rows, hidden, vv, scale=FLAT, seed=49)
        teacher = make_case(rows, hidden, vv, scale=FLAT, seed=50)
        temps = torch.linspace(0.4, 2.0, rows)
        capped: list[tuple[float | None, float | None]] = [(None, None)]
        if target.caps.softcap:
            capped.append((0.5, 0.75))
        for direction in directions:
            for pair in capped:
                _check_kl(
                    target,
                    case,
                    teacher,
                    direction,
                    temps,
                    temps.flip(0),
                    f"{direction} KL, per-token temperatures, softcap {pair[0]}, teacher softcap "
                    f"{pair[1]}, {case.description}",
                    pair,
                )


def _check_kl(
    target: Target,
    case: Case,
    teacher: Case,
    direction: str,
    t_s: Any,
    t_t: Any,
    label: str,
    caps: tuple[float | None, float | None] = (None, None),
    poison: bool = False,
) -> None:
    """One KL call against float64; ``caps``: the student's and the teacher's softcap;
    ``poison``: NaN/+-Inf in both heads' hidden states at the ignored rows, in the call alone."""
    dev, dt = target.device, target.dtype
    t_s, with_s = declared_temperature(target, t_s, label)
    t_t, with_t = declared_temperature(target, t_t, label)
    label = max(with_s, with_t, key=len)  # the note once, where either was raised
    called_s, called_t = case, replace(teacher, labels=case.labels)
    if poison:
        called_s, called_t = poison_ignored(called_s), poison_ignored(called_t)
        label += ", NaN/+Inf/-Inf hidden states of both heads at the ignored rows"
    hs = called_s.hidden.detach().to(dev, dt).requires_grad_(True)
    ws = case.weight.detach().to(dev, dt).requires_grad_(True)
    ht = called_t.hidden.detach().to(dev, dt).requires_grad_(True)
    wt = teacher.weight.detach().to(dev, dt).requires_grad_(True)
    y = case.labels.to(dev)
    ts = t_s.to(dev) if isinstance(t_s, torch.Tensor) else t_s
    tt = t_t.to(dev) if isinstance(t_t, torch.Tensor) else t_t
    try:
        kl = target.head.kl(
            hs,
            ws,
            ht,
            wt,
            y,
            direction=direction,
            temperature=ts,
            teacher_temperature=tt,
            softcap=caps[0],
            teacher_softcap=caps[1],
        )
    except Exception as exc:
        raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
    valid = case.labels != IGNORE_INDEX
    hd = case.hidden.detach().to(dt).double().requires_grad_(True)
    wd = case.weight.detach().to(dt).double().requires_grad_(True)
    htd, wtd = teacher.hidden.to(dt).double(), teacher.weight.to(dt).double()
    t_s_cpu = t_s if not isinstance(t_s, torch.Tensor) else t_s.double()
    t_t_cpu = t_t if not isinstance(t_t, torch.Tensor) else t_t.double()
    want, p_s, p_t = _kl_reference(hd, wd, htd, wtd, valid, t_s_cpu, t_t_cpu, direction, caps)
    zs, slope = reference_logits(hd.detach(), wd.detach(), t_s_cpu, caps[0])
    zt, _ = reference_logits(htd, wtd, t_t_cpu, caps[1])
    zmax = max(_zmax(zs, valid), _zmax(zt, valid))
    tol = target.tolerances(max(hd.shape[1], htd.shape[1]), wd.shape[0], zmax)
    g = _upstream(tuple(case.labels.shape), 51)
    try:
        if kl is None or tuple(kl.shape) != tuple(case.labels.shape) or kl.dtype != torch.float32:
            raise PropertyFailure(
                f"kl must be float32 of shape {tuple(case.labels.shape)}, got {None if kl is None else (kl.dtype, tuple(kl.shape))}"
            )
        assert_close("kl", kl.detach().cpu(), want.detach(), Bound(2 * tol.log_probs.scale))
        if bool((kl.detach().cpu()[~valid] != 0).any()):
            raise PropertyFailure("kl of ignored rows must be exactly 0")
        torch.autograd.backward([(kl.double() * g.to(dev, torch.float64)).sum()])
        torch.autograd.backward([(want * g.double()).sum()])
        ls = torch.log(p_s.detach())
        lt = torch.log(p_t.detach())
        if direction == "forward":
            d = g.double().abs().unsqueeze(1) * (p_s.detach() + p_t.detach())
        else:
            d = (
                g.double().abs().unsqueeze(1)
                * p_s.detach()
                * ((ls - lt).abs() + want.detach().abs().unsqueeze(1))
            )
        d[~valid] = 0.0
        m_h, m_w = magnitudes(d, hd.detach(), wd.detach(), slope, t_s_cpu)
        for leaf, got_g, ref_g, m in (
            ("hidden", hs.grad, hd.grad, m_h),
            ("weight", ws.grad, wd.grad, m_w),
        ):
            if got_g is None:
                raise PropertyFailure(f"grad of the student's {leaf} is None")
            assert ref_g is not None
            assert_close(f"grad {leaf}", got_g.detach().cpu(), ref_g, tol.grad, m)
        for leaf, t in (("teacher_hidden", ht), ("teacher_weight", wt)):
            if t.grad is not None and bool((t.grad != 0).any()):
                raise PropertyFailure(f"{leaf} got a gradient: the teacher must only be read")
        if bool((hs.grad.detach().cpu()[~valid] != 0).any()):  # type: ignore[union-attr]
            raise PropertyFailure("grad hidden of ignored rows must be exactly 0")
    except PropertyFailure as exc:
        raise PropertyFailure(f"{label}: {exc}") from None


OUTPUT_PROPERTIES: dict[str, Property] = {
    "topk_accuracy": topk_accuracy,
    "argmax_accuracy": argmax_accuracy,
    "gather_accuracy": gather_accuracy,
    "lse_and_sum_p2": lse_and_sum_p2,
    "extras_together": extras_together,
    "batch_invariant_extras": batch_invariant_extras,
    "kl_accuracy": kl_accuracy,
}
