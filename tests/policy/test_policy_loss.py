"""fused_policy_loss: verl's policy loss with its gradients computed in the forward.

Every backend that declares ``policy_loss`` is held to the float64 full-logits reference
(``fusedhead.reference.reference_policy_loss``, verl's formulas through autograd): the loss within
1e-5 and the gradients within 1e-4 relative, in fp32, across every aggregation crossed with dual
clip and TIS on and off, and with the entropy bonus and each KL estimator.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from policy_backends import POLICY_BACKENDS
from torch._dynamo.utils import counters

import fusedhead
from fusedhead.errors import BackendUnavailableError, CapabilityError
from fusedhead.reference import reference_policy_loss

AGGREGATIONS = [
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
PENALTIES: list[dict[str, Any]] = [
    {"entropy_coef": 0.01},
    {"kl_coef": 0.1, "kl_estimator": "k1"},
    {"kl_coef": 0.1, "kl_estimator": "k2"},
    {"kl_coef": 0.1, "kl_estimator": "k3", "entropy_coef": -0.02},
]


def batch(
    b: int = 3, s: int = 7, h: int = 16, v: int = 50, seed: int = 0, ignore_row: bool = True
) -> dict[str, torch.Tensor]:
    """A small RL batch whose ratios straddle both clip bounds (old log-probs near the new)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=g)
    weight = torch.randn(v, h, generator=g) / 3
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[0, 4:] = -100  # a ragged sequence
    if ignore_row:
        labels[2, :] = -100  # a fully ignored sequence
    with torch.no_grad():
        lp, _ = fusedhead.reference_fused_head(hidden, weight, labels, temperature=0.7)
    old = lp + 0.3 * torch.randn(b, s, generator=g)
    return {
        "hidden": hidden,
        "weight": weight,
        "labels": labels,
        "old_log_probs": old,
        "advantages": torch.randn(b, 1, generator=g),
        "ref_log_probs": lp + 0.2 * torch.randn(b, s, generator=g),
        "rollout_log_probs": old + 0.2 * torch.randn(b, s, generator=g),
    }


def run_both(
    backend: str, data: dict[str, torch.Tensor], **kw: Any
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what, fused, reference) for the loss and both gradients."""
    h = data["hidden"].clone().requires_grad_()
    w = data["weight"].clone().requires_grad_()
    args = {k: data[k] for k in ("labels", "old_log_probs", "advantages")}
    use = kw.pop("use", ())
    extra = {k: data[k] for k in ("ref_log_probs", "rollout_log_probs") if k in use}
    options = kw.pop("options", None)
    out = fusedhead.fused_policy_loss(h, w, **args, **extra, **kw, backend=backend, options=options)
    out.loss.backward()
    h64 = data["hidden"].double().requires_grad_()
    w64 = data["weight"].double().requires_grad_()
    ref = reference_policy_loss(h64, w64, **args, **extra, **kw)
    ref.backward()
    yield "loss", out.loss.detach(), ref.detach()
    assert h.grad is not None and w.grad is not None and h64.grad is not None
    yield "grad hidden", h.grad, h64.grad
    yield "grad weight", w.grad, w64.grad


def assert_matches(results: Iterator[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    for what, got, want in results:
        err = (got.double() - want).abs().max().item()
        if what == "loss":
            assert err <= 1e-5 * max(1.0, want.abs().item()), f"{what}: {got} vs {want}"
        else:
            rel = err / max(want.abs().max().item(), 1e-30)
            assert rel <= 1e-4, f"{what}: relative error {rel:.2e}"


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize(
    ("aggregation", "dual", "tis"),
    list(itertools.product(AGGREGATIONS, [None, 3.0], [False, True])),
)
@pytest.mark.parametrize("penalty", range(len(PENALTIES)))
def test_matches_verl_reference(
    backend: str, aggregation: str, dual: float | None, tis: bool, penalty: int
) -> None:
    kw: dict[str, Any] = dict(PENALTIES[penalty])
    use = ["ref_log_probs"] if "kl_coef" in kw else []
    if tis:
        use.append("rollout_log_probs")
        kw["tis_cap"] = 1.5
    data = batch(seed=penalty)
    assert_matches(
        run_both(
            backend,
            data,
            temperature=0.7,
            clip_low=0.2,
            clip_high=0.28,
            dual_clip=dual,
            aggregation=aggregation,
            use=use,
            **kw,
        )
    )


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize(
    "estimator", ["abs", "abs+", "k1+", "kl+", "k3+", "low_var_kl+", "mse+", "k3-unclamped"]
)
def test_every_kl_estimator_of_verl_and_trl_matches_the_reference(
    backend: str, estimator: str
) -> None:
    """verl's abs and straight-through '+' forms (the value, k2's gradient) and TRL's unclamped
    k3, with a reference 3 nats above some tokens: past k3's clamp of the KL at 10."""
    data = batch(seed=11)
    data["ref_log_probs"] = data["ref_log_probs"] + 3.0 * (torch.arange(7) % 2)
    kw = dict(kl_coef=0.1, kl_estimator=estimator, aggregation="seq-mean-token-mean")
    assert_matches(run_both(backend, data, temperature=0.7, use=["ref_log_probs"], **kw))


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_packed_batch_by_cu_seqlens(backend: str, aggregation: str) -> None:
    data = batch(b=1, s=19, seed=5, ignore_row=False)
    data["labels"][0, 3:5] = -100
    cu = torch.tensor([0, 5, 11, 11, 19], dtype=torch.int32)  # an empty sequence too
    per_sequence = torch.tensor([0.7, -1.2, 0.4, -0.3])  # GRPO: one advantage per sequence
    data["advantages"] = per_sequence.repeat_interleave(cu.diff().long())[None]
    assert_matches(
        run_both(backend, data, aggregation=aggregation, cu_seqlens=cu, entropy_coef=0.01)
    )


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum"])
def test_loss_normalizer_replaces_the_count(backend: str, aggregation: str) -> None:
    data = batch(seed=3)
    assert_matches(run_both(backend, data, aggregation=aggregation, loss_normalizer=40.0))
    as_tensor = torch.tensor(40.0)
    a = fusedhead.fused_policy_loss(
        **_args(data), aggregation=aggregation, loss_normalizer=as_tensor, backend=backend
    )
    b = fusedhead.fused_policy_loss(
        **_args(data), aggregation=aggregation, loss_normalizer=40, backend=backend
    )
    assert torch.equal(a.loss, b.loss)


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_with_loss_normalizer_and_horizon_packed_micro_batches_add_up(backend: str) -> None:
    """seq-mean-token-sum-norm divides by sequences x horizon. A packed batch's default horizon,
    its longest sequence, changes from one micro-batch to the next; ``horizon`` (verl's
    loss_scale_factor, TRL's max_completion_length) fixes it, so split batches add up."""
    data = batch(b=1, s=17, seed=9, ignore_row=False)
    data["advantages"] = data["advantages"].expand(1, 17) + torch.linspace(-1, 1, 17)
    whole_cu = [0, 3, 11, 17]  # micro-batches below: the first sequence, then the other two

    def loss_and_grad(lo: int, hi: int, cu: list[int], **kw: Any) -> tuple[torch.Tensor, ...]:
        part = {k: v if k == "weight" else v[:, lo:hi] for k, v in data.items()}
        args = _args(part, w=True)
        out = fusedhead.fused_policy_loss(
            **args, aggregation="seq-mean-token-sum-norm", cu_seqlens=torch.tensor(cu),
            loss_normalizer=3, backend=backend, **kw,
        )  # fmt: skip
        out.loss.backward()
        return out.loss.detach(), args["weight"].grad

    whole, whole_grad = loss_and_grad(0, 17, whole_cu, horizon=8)
    first, g1 = loss_and_grad(0, 3, [0, 3], horizon=8)
    second, g2 = loss_and_grad(3, 17, [0, 8, 14], horizon=8)
    torch.testing.assert_close(first + second, whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(g1 + g2, whole_grad, rtol=1e-5, atol=1e-7)
    # horizon=8 is the whole batch's longest sequence: its default, not each micro-batch's
    assert torch.equal(loss_and_grad(0, 17, whole_cu)[0], whole)
    assert not torch.allclose(loss_and_grad(0, 3, [0, 3])[0], first)
    # and the norm mode is the sequence sum divided by the horizon
    summed = fusedhead.fused_policy_loss(
        **_args(data), aggregation="seq-mean-token-sum", backend=backend
    )
    normed = fusedhead.fused_policy_loss(
        **_args(data), aggregation="seq-mean-token-sum-norm", horizon=64, backend=backend
    )
    torch.testing.assert_close(normed.loss, summed.loss / 64, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_per_token_temperature_and_softcap(backend: str) -> None:
    data = batch(seed=7)
    temp = 0.5 + torch.rand(3, 7, generator=torch.Generator().manual_seed(1))
    assert_matches(run_both(backend, data, temperature=temp, softcap=3.0, entropy_coef=0.01))


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize(("cap", "scale"), [(1.0, 8.0), (30.0, 20.0)], ids=["cap1", "cap30"])
def test_16_bit_gradients_under_a_saturating_softcap(
    backend: str, cap: float, scale: float
) -> None:
    """fp16 (bf16 dots are wrong under the Triton interpreter), logits far past the cap: the cap's
    derivative comes from the raw logit, so the gradients stay within two fp16 roundings (2^-10)
    of float64. The triton backend rebuilt it as ``1 - tanh^2`` from a capped logit kept in fp16
    (6.5e-2 at cap 1)."""
    g = torch.Generator().manual_seed(4)
    data = {
        "hidden": torch.randn(2, 6, 16, generator=g).half().float(),
        "weight": (torch.randn(48, 16, generator=g) * scale).half().float(),
        "labels": torch.randint(0, 48, (2, 6), generator=g),
        "advantages": torch.randn(2, 6, generator=g),
    }
    h = data["hidden"].half().requires_grad_()
    w = data["weight"].half().requires_grad_()
    kw: dict[str, Any] = {"softcap": cap, "temperature": 1.3, "entropy_coef": 0.01}
    out = fusedhead.fused_policy_loss(
        h, w, data["labels"], old_log_probs=None, advantages=data["advantages"], backend=backend,
        **kw,
    )  # fmt: skip
    out.loss.backward()
    h64 = data["hidden"].double().requires_grad_()
    w64 = data["weight"].double().requires_grad_()
    reference_policy_loss(
        h64, w64, data["labels"], old_log_probs=None, advantages=data["advantages"], **kw
    ).backward()
    for what, got, want in (("hidden", h.grad, h64.grad), ("weight", w.grad, w64.grad)):
        assert got is not None and want is not None
        rel = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert rel <= 2.0**-10, f"grad {what}: relative error {rel:.2e}"


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_fp16_gradients_reach_a_gradscalers_scale(backend: str) -> None:
    """fp16 with a token-mean over a global count of 2**18 tokens (many micro-batches and ranks,
    verl's and TRL's normalisation): the gradients are 2**-18 of a sum's and, formed at scale 1,
    flushed to zero before a GradScaler's 65536 reached them. Formed at each chunk's scale, the scaled backward is within
    a few fp16 roundings of float64, as autograd's own backward of the same loss is."""
    g = torch.Generator().manual_seed(5)
    n, h_size, v, total, scale = 512, 64, 1000, 2.0**18, 65536.0
    hidden = torch.randn(n, h_size, generator=g).half().float()
    weight = (torch.randn(v, h_size, generator=g) / 3).half().float()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::10] = -100
    with torch.no_grad():
        lp, _ = fusedhead.reference_fused_head(hidden, weight, labels)
    kw: dict[str, Any] = {
        "old_log_probs": lp + 0.1 * torch.randn(n, generator=g),
        "advantages": torch.randn(n, generator=g),
        "loss_normalizer": total,
    }
    h = hidden.half().requires_grad_()
    w = weight.half().requires_grad_()
    out = fusedhead.fused_policy_loss(h, w, labels, backend=backend, **kw)
    (out.loss * scale).backward()
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    reference_policy_loss(h64, w64, labels, **kw).backward()
    for what, got, want in (("hidden", h.grad, h64.grad), ("weight", w.grad, w64.grad)):
        assert got is not None and want is not None
        rel = ((got.double() / scale - want).norm() / want.norm()).item()
        assert rel <= 2e-3, f"grad {what}: relative error {rel:.2e}"
        flushed = ((got == 0) & (want != 0)).sum().item()
        assert flushed == 0, f"grad {what}: {flushed} nonzero values flushed to 0"


@pytest.mark.slow
@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_an_fp16_weight_gradient_past_65504_at_the_chunks_scale_is_kept(backend: str) -> None:
    """4096 tokens with one label and a hidden component of 200: the weight gradient is 200, and
    at its chunk's scale its sum passes fp16's 65504 (it came back inf under a fixed working
    scale). The backend hands the fp32 sum to the core, which rounds it after the upstream
    scale: finite, within fp16 rounding."""
    g = torch.Generator().manual_seed(0)
    n, h_size, v = 4096, 8, 16
    hidden = (torch.randn(n, h_size, generator=g) * 0.1).half().float()
    hidden[:, 0] = 200.0
    weight = (torch.randn(v, h_size, generator=g) / 3).half().float()
    labels = torch.zeros(n, dtype=torch.long)
    kw: dict[str, Any] = {"old_log_probs": None, "advantages": torch.ones(n)}
    h = hidden.half().requires_grad_()
    w = weight.half().requires_grad_()
    fusedhead.fused_policy_loss(h, w, labels, backend=backend, **kw).loss.backward()
    w64 = weight.double().requires_grad_()
    reference_policy_loss(hidden.double(), w64, labels, **kw).backward()
    assert w.grad is not None and w64.grad is not None and w.grad.dtype == torch.float16
    assert w64.grad.abs().max().item() == pytest.approx(200.0, rel=1e-3)
    rel = ((w.grad.double() - w64.grad).norm() / w64.grad.norm()).item()
    assert rel <= 2.0**-10, f"grad weight: relative error {rel:.2e}"


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_fp16_logit_offsets_past_65504_keep_finite_gradients(backend: str) -> None:
    """|z| / T up to 1e5 (fp16 logits of 5e3 at T = 0.05): the triton backend kept each tile's
    offsets d = z - max in fp16, where those past 65504 became -inf and the gradients NaN at
    every loss scale. Kept at -2**15 at most (exp is 0 there in fp32 anyway): finite, and as
    near float64's as the logits' conditioning allows."""
    g = torch.Generator().manual_seed(0)
    n, h_size, v, temp = 64, 16, 256, 0.05
    hidden = torch.randn(n, h_size, generator=g)
    weight = torch.randn(v, h_size, generator=g)
    c = (5e3 / (hidden @ weight.T).abs().max()).sqrt()
    hidden, weight = (hidden * c).half().float(), (weight * c).half().float()
    labels = torch.randint(0, v, (n,), generator=g)
    with torch.no_grad():
        lp, _ = fusedhead.reference_fused_head(hidden, weight, labels, temperature=temp)
    kw: dict[str, Any] = {
        "old_log_probs": lp,
        "advantages": torch.randn(n, generator=g),
        "temperature": temp,
    }
    h = hidden.half().requires_grad_()
    w = weight.half().requires_grad_()
    fusedhead.fused_policy_loss(h, w, labels, backend=backend, **kw).loss.backward()
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    reference_policy_loss(h64, w64, labels, **kw).backward()
    for what, got, want in (("hidden", h.grad, h64.grad), ("weight", w.grad, w64.grad)):
        assert got is not None and want is not None
        assert bool(torch.isfinite(got).all()), f"grad {what} is not finite"
        rel = ((got.double() - want).norm() / want.norm()).item()
        # the logits' own fp32 rounding at |z| / T = 1e5 (the torch backend's 4.3e-3 too)
        assert rel <= 2.0**-6, f"grad {what}: relative error {rel:.2e}"


def test_a_chunks_scale_puts_its_largest_dz_bound_under_2_to_the_14() -> None:
    """fp16: a power of two s with s * max_rows k (|g_lp| + |g_H| (1/2 + H)) in (2**13, 2**14];
    1 for bf16 and fp32, for a chunk without gradient, and past NaN temperatures of rows whose
    derivatives are 0 (ignored rows of an unchecked call)."""
    from fusedhead.fp16_range import chunk_scale

    ent = torch.tensor([2.0, 0.5, 7.0])
    for top in (2.0**-18 * 3, 1.0, 5.0e5):
        g_lp = torch.tensor([top, -top / 7, 0.0])
        g_ent = torch.tensor([0.0, top / 9, 0.0])
        k = torch.tensor([1.0, 2.0, float("nan")])
        s = chunk_scale(torch.float16, g_lp, g_ent, ent, k)
        assert math.frexp(s)[0] == 0.5, f"{s} is no power of two"
        bound = max(top, 2 * (top / 7 + top / 9 * 1.0))
        assert 2.0**13 < s * bound <= 2.0**14, (top, s)
        for other in (torch.bfloat16, torch.float32):
            assert chunk_scale(other, g_lp, g_ent, ent, k) == 1.0
    zeros = torch.zeros(3)
    assert chunk_scale(torch.float16, zeros, zeros, ent, torch.ones(3)) == 1.0


def _args(data: dict[str, torch.Tensor], **grad: bool) -> dict[str, Any]:
    return {
        "hidden": data["hidden"].clone().requires_grad_(grad.get("h", False)),
        "weight": data["weight"].clone().requires_grad_(grad.get("w", False)),
        "labels": data["labels"],
        "old_log_probs": data["old_log_probs"],
        "advantages": data["advantages"],
    }


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_ignored_rows_add_nothing_whatever_their_values(backend: str, poison: float) -> None:
    data = batch(seed=2)
    clean = _args(data, h=True, w=True)
    out_clean = fusedhead.fused_policy_loss(**clean, entropy_coef=0.01, backend=backend)
    out_clean.loss.backward()
    dirty = _args(data, h=False, w=True)
    ignored = data["labels"] == -100
    h = dirty["hidden"].detach().clone()
    h[ignored] = poison
    h.requires_grad_()
    dirty["hidden"] = h
    old = data["old_log_probs"].clone()
    old[ignored] = poison
    dirty["old_log_probs"] = old
    out = fusedhead.fused_policy_loss(**dirty, entropy_coef=0.01, backend=backend)
    out.loss.backward()
    assert torch.equal(out.loss, out_clean.loss)
    assert h.grad is not None and dirty["weight"].grad is not None
    assert torch.isfinite(dirty["weight"].grad).all()
    assert torch.equal(h.grad[ignored], torch.zeros_like(h.grad[ignored]))
    assert torch.equal(dirty["weight"].grad, clean["weight"].grad)
    assert torch.equal(out.log_probs[ignored], torch.zeros_like(out.log_probs[ignored]))
    assert torch.equal(out.entropy[ignored], torch.zeros_like(out.entropy[ignored]))


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_upstream_scale_and_accumulation(backend: str) -> None:
    data = batch(seed=4)
    once = _args(data, h=True, w=True)
    fusedhead.fused_policy_loss(**once, backend=backend).loss.backward()
    scaled = _args(data, h=True, w=True)
    (fusedhead.fused_policy_loss(**scaled, backend=backend).loss * 0.25).backward()
    for a, b in ((once["hidden"], scaled["hidden"]), (once["weight"], scaled["weight"])):
        torch.testing.assert_close(b.grad, a.grad * 0.25, rtol=1e-6, atol=1e-9)
    # Two micro-batches into one .grad: the sum of each's gradient.
    for _ in range(2):
        fusedhead.fused_policy_loss(**{**once}, backend=backend).loss.backward()
    torch.testing.assert_close(
        once["weight"].grad, scaled["weight"].grad * 12, rtol=1e-5, atol=1e-8
    )


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("scale", [65536.0, 1 / 3], ids=["grad-scaler", "third"])
def test_an_upstream_scale_multiplies_16_bit_gradients_in_fp32_rounded_once(
    backend: str, dtype: torch.dtype, scale: float
) -> None:
    """Before: on the CPU the scale was first rounded to the gradients' dtype (fp16: a
    GradScaler's 65536 is inf, so an ignored row's zero gradient became NaN; bf16: 1/3 off by
    0.2 %). Each element is now its unscaled value times the scale in fp32, rounded once. fp16
    gradients are held in fp32 until the backward (fusedhead.fp16_range) and rounded once after
    the scale: within one fp16 rounding of the rounded unscaled gradient times the scale."""
    if backend == "triton" and dtype == torch.bfloat16:
        pytest.skip("bf16 tl.dot is wrong under the Triton interpreter (checked on a GPU)")
    data = batch(seed=5)
    grads = []
    for s in (1.0, scale):
        args = _args(data, h=True, w=True)
        args["hidden"] = args["hidden"].detach().to(dtype).requires_grad_()
        args["weight"] = args["weight"].detach().to(dtype).requires_grad_()
        (fusedhead.fused_policy_loss(**args, backend=backend).loss * s).backward()
        grads.append((args["hidden"].grad, args["weight"].grad))
    ignored = data["labels"] == -100
    for once, scaled in zip(grads[0], grads[1], strict=True):
        assert once is not None and scaled is not None
        normal = once.abs() >= torch.finfo(dtype).tiny
        want = (once[normal].float() * scale).to(dtype)
        if dtype == torch.float16:
            # one fp16 rounding of the unscaled gradient (an overflow to inf on both sides)
            torch.testing.assert_close(scaled[normal], want, rtol=2.0**-10, atol=0.0)
        else:
            assert torch.equal(scaled[normal], want)
    assert torch.equal(grads[1][0][ignored], torch.zeros_like(grads[1][0][ignored]))


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_a_non_finite_upstream_scale_leaves_ignored_rows_at_zero(
    backend: str, scale: float
) -> None:
    """Before: the stored zeros of ignored rows were multiplied by the scale, inf * 0 = NaN, where
    the autograd of the same loss gives them 0. The scored rows take the scale as autograd does."""
    data = batch(seed=5)
    once, scaled = _args(data, h=True, w=True), _args(data, h=True, w=True)
    fusedhead.fused_policy_loss(**once, backend=backend).loss.backward()
    (fusedhead.fused_policy_loss(**scaled, backend=backend).loss * scale).backward()
    ignored = data["labels"] == -100
    assert ignored.any() and (~ignored).any()
    grad = scaled["hidden"].grad
    assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))
    for a, b in ((once["hidden"], scaled["hidden"]), (once["weight"], scaled["weight"])):
        moved = a.grad != 0
        assert moved.any() and not torch.isfinite(b.grad[moved]).any()
        assert torch.equal(b.grad[~moved], a.grad[~moved])


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_deterministic(backend: str) -> None:
    data = batch(seed=6)
    runs = []
    for _ in range(2):
        args = _args(data, h=True, w=True)
        out = fusedhead.fused_policy_loss(**args, entropy_coef=0.01, backend=backend)
        out.loss.backward()
        runs.append((out.loss, args["hidden"].grad, args["weight"].grad, out.metrics()))
    (l1, h1, w1, m1), (l2, h2, w2, m2) = runs
    assert torch.equal(l1, l2) and torch.equal(h1, h2) and torch.equal(w1, w2)
    assert all(torch.equal(m1[k], m2[k]) for k in m1)


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_second_backward_and_create_graph_are_refused(backend: str) -> None:
    data = batch(seed=8)
    args = _args(data, h=True, w=True)
    out = fusedhead.fused_policy_loss(**args, backend=backend)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.loss.backward()
    out = fusedhead.fused_policy_loss(**args, backend=backend)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(out.loss, [args["hidden"]], create_graph=True)


def test_metrics_are_verl_s() -> None:
    """clip fraction, approx KL and the ratio's range as verl computes them (masked means)."""
    data = batch(seed=9)
    out = fusedhead.fused_policy_loss(**_args(data), temperature=0.7, clip_high=0.28, dual_clip=3.0)
    mask = data["labels"] != -100
    lp, _ = fusedhead.reference_fused_head(
        data["hidden"].double(), data["weight"].double(), data["labels"], temperature=0.7
    )
    log_ratio = (lp - data["old_log_probs"].double()).clamp(-20, 20)[mask]
    ratio = log_ratio.exp()
    adv = data["advantages"].double().expand(3, 7)[mask]
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(0.8, 1.28)
    clip1 = torch.maximum(pg1, pg2)
    expect = {
        "clip_fraction": (pg2 > pg1).double().mean(),
        "clip_fraction_lower": ((clip1 > -adv * 3.0) & (adv < 0)).double().mean(),
        "approx_kl": (-log_ratio).mean(),
        "ratio_mean": ratio.mean(),
        "ratio_min": ratio.min(),
        "ratio_max": ratio.max(),
    }
    got = out.metrics()
    for k, v in expect.items():
        assert abs(got[k].item() - v.item()) <= 1e-5, k
        assert got[k].dtype == torch.float32 and got[k].dim() == 0
    assert "kl" not in got  # no reference policy given


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"aggregation": "token_mean"}, ValueError, "did you mean 'token-mean'"),
        ({"aggregation": "gspo"}, ValueError, "GSPO"),
        ({"aggregation": 3}, TypeError, "aggregation must be a str"),
        ({"kl_estimator": "k4"}, ValueError, "kl_estimator must be one of"),
        ({"kl_coef": 0.1}, ValueError, "kl_coef=0.1 needs ref_log_probs"),
        ({"tis_cap": 2.0}, ValueError, "tis_cap was given without rollout_log_probs"),
        ({"clip_low": -0.1}, ValueError, "clip_low must be a finite float >= 0, got -0.1"),
        ({"clip_high": float("nan")}, ValueError, "clip_high must be"),
        ({"dual_clip": 1.0}, ValueError, "dual_clip must be > 1"),
        ({"entropy_coef": True}, TypeError, "entropy_coef must be a float"),
        (
            {"old_log_probs": torch.zeros(3, 6)},
            ValueError,
            r"old_log_probs must have the labels' shape",
        ),
        (
            {"advantages": torch.zeros(3, 7, dtype=torch.int64)},
            TypeError,
            "advantages must be a floating",
        ),
        ({"loss_normalizer": -1.0}, ValueError, "loss_normalizer must be"),
        ({"cu_seqlens": torch.tensor([0, 21])}, ValueError, "packed batch"),
        (
            {"old_log_probs": None, "rollout_log_probs": torch.zeros(3, 7), "tis_cap": 2.0},
            ValueError,
            "rollout_log_probs was given with old_log_probs=None",
        ),
        (
            {"advantages": torch.zeros(7)},
            ValueError,
            r"advantages must have the labels' shape \(3, 7\) or \(3, 1\) \(one value per "
            r"sequence\), got \(7,\)",
        ),
        # One sequence's values (or one value) spread over the batch is a mistake, not a broadcast.
        ({"advantages": torch.zeros(1, 7)}, ValueError, r"advantages .* got \(1, 7\)"),
        ({"advantages": torch.zeros(())}, ValueError, r"advantages .* got \(\)"),
        (
            {"old_log_probs": torch.zeros(1, 7)},
            ValueError,
            r"old_log_probs .* \(3, 7\), got \(1, 7\)",
        ),
        (
            {"old_log_probs": torch.zeros(3, 1)},
            ValueError,
            r"old_log_probs .* \(3, 7\), got \(3, 1\)",
        ),
        ({"old_log_probs": torch.tensor(-1.0)}, ValueError, r"old_log_probs .* got \(\)"),
        (
            {"ref_log_probs": torch.zeros(1, 7), "kl_coef": 0.1},
            ValueError,
            r"ref_log_probs must have the labels' shape \(3, 7\), got \(1, 7\)",
        ),
        (
            {"rollout_log_probs": torch.zeros(()), "tis_cap": 2.0},
            ValueError,
            r"rollout_log_probs must have the labels' shape \(3, 7\), got \(\)",
        ),
        ({"old_log_probs": [0.0] * 21}, TypeError, r"old_log_probs must be a torch.Tensor or None"),
        ({"kl_estimator": "K3"}, ValueError, "did you mean 'k3'"),
        ({"aggregation": "Token-Mean"}, ValueError, "did you mean 'token-mean'"),
        ({"horizon": 8}, ValueError, r"horizon=8 is the length seq-mean-token-sum-norm divides"),
        (
            {"horizon": 0, "aggregation": "seq-mean-token-sum-norm"},
            ValueError,
            r"horizon must be a length > 0 \(verl's loss_scale_factor",
        ),
        (
            {"horizon": "8", "aggregation": "seq-mean-token-sum-norm"},
            TypeError,
            "horizon must be a float",
        ),
        (
            {"advantages": torch.zeros(3, 1, requires_grad=True)},
            ValueError,
            r"advantages requires grad, .* pass advantages.detach\(\)",
        ),
        (
            {"old_log_probs": torch.zeros(3, 7, requires_grad=True)},
            ValueError,
            r"old_log_probs requires grad",
        ),
        (
            {"ref_log_probs": 0.5, "kl_coef": 0.1},
            TypeError,
            r"ref_log_probs must be a torch.Tensor or None \(no KL term\), got float",
        ),
    ],
)
def test_bad_arguments_are_named(kw: dict[str, Any], error: type, match: str) -> None:
    args = _args(batch(seed=1))
    args.update(kw)
    with pytest.raises(error, match=match):
        fusedhead.fused_policy_loss(**args)


def test_bad_cu_seqlens_values() -> None:
    data = batch(b=1, s=10, seed=1, ignore_row=False)
    data["advantages"] = data["advantages"].expand(1, 10)
    with pytest.raises(ValueError, match=r"cu_seqlens must be on hidden's device cpu, got meta"):
        fusedhead.fused_policy_loss(**_args(data), cu_seqlens=torch.tensor([0, 10], device="meta"))
    for bad in ([0, 4, 3, 10], [1, 10], [0, 4, 9]):
        with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
            fusedhead.fused_policy_loss(**_args(data), cu_seqlens=torch.tensor(bad))


def test_a_backend_without_the_capability_is_refused() -> None:
    from fusedhead.protocol import Capabilities
    from fusedhead_torch.backend import TorchBackend

    class NoPolicy(TorchBackend):
        name = "no-policy-test"

        def capabilities(self, device: torch.device) -> Capabilities:
            return super().capabilities(device).model_copy(update={"policy_loss": False})

    fusedhead.register_backend("no-policy-test", NoPolicy)
    try:
        with pytest.raises(CapabilityError, match="policy_loss") as info:
            fusedhead.fused_policy_loss(**_args(batch()), backend="no-policy-test")
        assert info.value.capability == "policy_loss"
    finally:
        fusedhead.unregister_backend("no-policy-test")
        fusedhead.refresh()


def test_the_policy_loss_needs_no_head_output_beyond_log_probs() -> None:
    """The loss's entropy is the policy call's own output: a backend that declares policy_loss
    and, as a head, only log_probs runs it (it was refused for not computing the head's entropy)."""
    from fusedhead.protocol import Capabilities
    from fusedhead_torch.backend import TorchBackend

    seen: list[frozenset[str]] = []

    class LogProbsHead(TorchBackend):
        name = "log-probs-head-test"

        def capabilities(self, device: torch.device) -> Capabilities:
            only = ("log_probs",)
            update = {"outputs": only, "vocab_parallel_outputs": only}
            return super().capabilities(device).model_copy(update=update)

        def policy_loss(self, call: Any) -> Any:
            seen.append(call.head.outputs)
            return super().policy_loss(call)

    fusedhead.register_backend(LogProbsHead.name, LogProbsHead)
    data = batch(seed=12)
    try:
        got = fusedhead.fused_policy_loss(**_args(data), backend=LogProbsHead.name)
        want = fusedhead.fused_policy_loss(**_args(data), backend="torch")
        torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
        torch.testing.assert_close(got.entropy, want.entropy, rtol=0, atol=0)
        assert seen == [frozenset({"log_probs", "entropy"})]  # the protocol's head call, unchanged
        with pytest.raises(CapabilityError, match="entropy"):  # as a head it computes no entropy
            fusedhead.fused_head(
                data["hidden"], data["weight"], data["labels"], backend=LogProbsHead.name
            )
    finally:
        fusedhead.unregister_backend(LogProbsHead.name)
        fusedhead.refresh()


def test_a_backend_unavailable_here_that_lacks_the_capability_says_it_lacks_it() -> None:
    """Before: liger on a CPU was told to install the CuTe DSL or run on a GPU, where the same
    call is refused for want of policy_loss."""
    from fusedhead.bench import peers
    from fusedhead.bench.cases import Case
    from fusedhead.protocol import Capabilities
    from fusedhead_torch.backend import TorchBackend

    class NoPolicyNowhere(TorchBackend):
        """Like liger on a CPU: unavailable here, and no policy loss anywhere."""

        name = "no-policy-unavailable-test"

        def check(self, device: torch.device, dtype: torch.dtype) -> None:
            raise BackendUnavailableError("needs a GPU here", hint="install a GPU runtime")

        def capabilities(self, device: torch.device) -> Capabilities:
            return super().capabilities(device).model_copy(update={"policy_loss": False})

    fusedhead.register_backend(NoPolicyNowhere.name, NoPolicyNowhere)
    data = batch()
    try:
        with pytest.raises(CapabilityError, match="does not declare policy_loss"):
            fusedhead.fused_policy_loss(**_args(data), backend=NoPolicyNowhere.name)
        reason = peers.resolve(NoPolicyNowhere.name).availability(Case(8, 4, 16, head="policy"))
        assert reason is not None and "does not declare policy_loss" in reason
        assert "GPU" not in reason
        with pytest.raises(BackendUnavailableError, match="needs a GPU here"):  # its other calls
            fusedhead.fused_head(
                data["hidden"], data["weight"], data["labels"], backend=NoPolicyNowhere.name
            )
    finally:
        fusedhead.unregister_backend(NoPolicyNowhere.name)
        fusedhead.refresh()


def test_no_grad_returns_the_loss_without_gradients() -> None:
    data = batch(seed=10)
    with torch.no_grad():
        out = fusedhead.fused_policy_loss(**_args(data, h=True, w=True), entropy_coef=0.01)
    assert not out.loss.requires_grad
    ref = reference_policy_loss(
        data["hidden"].double(),
        data["weight"].double(),
        **{k: data[k] for k in ("labels", "old_log_probs", "advantages")},
        entropy_coef=0.01,
    )
    assert abs(out.loss.item() - ref.item()) <= 1e-5


#: Each backend's option for a small row chunk: the gradients summed over several chunks.
SMALL_CHUNKS = {"torch": {"chunk_rows": 8}, "triton": {"policy_chunk_rows": 8}}


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_several_row_chunks(backend: str, aggregation: str) -> None:
    data = batch(seed=11)
    assert_matches(
        run_both(
            backend,
            data,
            aggregation=aggregation,
            entropy_coef=0.01,
            temperature=0.9,
            options=SMALL_CHUNKS[backend],
            dual_clip=2.0,
        )
    )


def test_torch_compiled_chunks_match_the_reference() -> None:
    """The torch backend's CUDA default (its elementwise work through torch.compile), on the CPU."""
    data = batch(seed=12)
    assert_matches(
        run_both(
            "torch",
            data,
            temperature=0.8,
            entropy_coef=0.01,
            options={"compile_elementwise": True, "chunk_rows": 8},
            use=["ref_log_probs"],
            kl_coef=0.05,
        )
    )


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("torch", torch.float32), ("torch", torch.bfloat16), ("triton", torch.float32)],
    ids=["torch-fp32", "torch-bf16", "triton-fp32"],
)
def test_inside_torch_compile_the_call_is_a_graph_break_with_eager_results(
    backend: str, dtype: torch.dtype
) -> None:
    """In a ``torch.compile``d step the backend runs as in eager mode, never compiled by Dynamo
    (the triton backend's kernel launches, compiled as a frame of their own, failed there), on
    the same scored rows: the same loss, metrics and gradients, bit for bit, under an upstream
    scale; and Dynamo never traces the backward (its host read of the scale: a graph break
    and a warning on the user's console)."""
    data = batch(seed=14)
    data["hidden"], data["weight"] = data["hidden"].to(dtype), data["weight"].to(dtype)
    kw: dict[str, Any] = dict(temperature=0.8, entropy_coef=0.01, dual_clip=3.0, backend=backend)

    def step(args: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        out = fusedhead.fused_policy_loss(**args, **kw)
        return out.loss, out.clip_fraction

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = _args(data, h=True, w=True), _args(data, h=True, w=True)
    want = step(eager)
    got = torch.compile(step, backend="eager")(compiled)
    (want[0] * 0.5).backward()
    (got[0] * 0.5).backward()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(compiled["hidden"].grad, eager["hidden"].grad)
    assert torch.equal(compiled["weight"].grad, eager["weight"].grad)
    assert not [why for why in counters["graph_break"] if "item()" in why]


def test_fullgraph_names_fused_policy_loss_and_the_way_out() -> None:
    """Dynamo's own refusal said only "Skip calling torch.compiler.disable()d function"."""
    data = batch(seed=15)

    def step(args: dict[str, Any]) -> torch.Tensor:
        return fusedhead.fused_policy_loss(**args, backend="torch").loss

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"(?s)fused_policy_loss .*compile without fullgraph"):
        torch.compile(step, backend="eager", fullgraph=True)(_args(data, h=True, w=True))


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum-norm"])
def test_old_log_probs_none_is_on_policy(backend: str, aggregation: str) -> None:
    """``old_log_probs=None``: the old policy is the current one (TRL's and verl's
    ``lp - lp.detach()``): the reference with the same meaning, and the fused loss given its own
    log-probs as the old ones; the ratio is 1, nothing is clipped, the approximate KL is 0."""
    data = batch(seed=13)
    data["old_log_probs"] = None  # type: ignore[assignment]
    kw: dict[str, Any] = dict(temperature=0.8, aggregation=aggregation, entropy_coef=0.01)
    assert_matches(
        run_both(backend, data, use=["ref_log_probs"], kl_coef=0.05, dual_clip=3.0, **kw)
    )
    a, b = _args(data, h=True, w=True), _args(data, h=True, w=True)
    none = fusedhead.fused_policy_loss(**a, backend=backend, **kw)
    b["old_log_probs"] = none.log_probs  # detached: the current policy's, as given
    given = fusedhead.fused_policy_loss(**b, backend=backend, **kw)
    none.loss.backward()
    given.loss.backward()
    assert torch.equal(none.loss, given.loss)
    assert torch.equal(a["hidden"].grad, b["hidden"].grad)
    assert torch.equal(a["weight"].grad, b["weight"].grad)
    m = none.metrics()
    assert m["ratio_min"].item() == m["ratio_max"].item() == 1.0
    assert m["clip_fraction"].item() == 0.0 and m["approx_kl"].item() == 0.0


TORCH_PATHS = [
    pytest.param({"compile_elementwise": False, "chunk_rows": 8}, id="torch-eager"),
    pytest.param({"compile_elementwise": True, "chunk_rows": 8}, id="torch-compiled"),
]


@pytest.mark.parametrize("options", TORCH_PATHS)
@pytest.mark.parametrize("temperature", [1e-25, 1e-10])
def test_tiny_temperatures_give_the_reference_not_nan(
    options: dict[str, Any], temperature: float
) -> None:
    """At ``T = 1e-10`` a fused ``k x - k max x`` left the max's ``d`` at the rounding of
    ``k max x`` (thousands): the eager path's loss was NaN. And ``b d`` alone overflows where
    ``e`` is 0: with an entropy bonus the gradients were NaN on both paths. Without the entropy
    term the float64 reference's gradients are finite too (its ``p log p`` is NaN at ``p = 0``)."""
    data = batch(seed=21)
    kw: dict[str, Any] = dict(temperature=temperature, options=options)
    assert_matches(run_both("torch", data, **kw))
    h = data["hidden"].clone().requires_grad_()
    w = data["weight"].clone().requires_grad_()
    args = {k: data[k] for k in ("labels", "old_log_probs", "advantages")}
    out = fusedhead.fused_policy_loss(h, w, **args, entropy_coef=0.01, backend="torch", **kw)
    out.loss.backward()
    ref = reference_policy_loss(
        data["hidden"].double(), data["weight"].double(), **args, temperature=temperature,
        entropy_coef=0.01,
    )  # fmt: skip
    assert abs(out.loss.item() - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
    assert h.grad is not None and w.grad is not None
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
def test_torch_weight_gradient_rounds_once_whatever_the_chunks(device: str) -> None:
    """bf16: the weight gradient summed over 128 row chunks is as close to float64 as over one
    (a bf16 running sum rounds once per chunk: 2.9x one chunk's error at this size)."""
    g = torch.Generator().manual_seed(21)
    n, h, v = 1024, 64, 300
    data = {
        "hidden": torch.randn(n, h, generator=g).bfloat16(),
        "weight": (torch.randn(v, h, generator=g) / 8).bfloat16(),
        "labels": torch.randint(0, v, (n,), generator=g),
        "old_log_probs": torch.randn(n, generator=g) * 0.1 - 5,
        "advantages": torch.randn(n, generator=g),
    }
    kw = {"temperature": 0.7, "entropy_coef": 0.01}
    w64 = data["weight"].double().requires_grad_()
    args64 = {k: t.double() if t.is_floating_point() else t for k, t in data.items()}
    args64["weight"] = w64
    reference_policy_loss(**args64, **kw).backward()
    assert w64.grad is not None

    def error(rows: int) -> float:
        on = {k: t.to(device, copy=True) for k, t in data.items()}
        w = on.pop("weight").requires_grad_()
        out = fusedhead.fused_policy_loss(
            weight=w, **on, **kw, backend="torch",
            options={"chunk_rows": rows, "compile_elementwise": False},
        )  # fmt: skip
        out.loss.backward()
        assert w.grad is not None and w.grad.dtype == torch.bfloat16
        diff = w.grad.cpu().double() - w64.grad
        return (diff.norm() / w64.grad.norm()).item()

    one, many = error(n), error(8)
    assert one < 4e-3
    assert many <= 1.1 * one, f"128 chunks: {many:.2e} against one chunk's {one:.2e}"


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize("clip_low", [1.0, 1.5])
def test_clip_low_1_or_more_is_no_lower_clip(backend: str, clip_low: float) -> None:
    """clip_low >= 1 (verl's clip_ratio_low, TRL's epsilon) puts the lower bound at or below 0,
    as verl and TRL run it: ratios below 1 - 0.2 with a negative advantage keep their slope."""
    data = batch(seed=5)
    data["old_log_probs"] = data["old_log_probs"] + 0.5  # ratios well below 0.8
    data["advantages"] = -data["advantages"].abs()
    kw: dict[str, Any] = dict(temperature=0.7, clip_high=0.28, aggregation="token-mean")
    assert_matches(run_both(backend, data, clip_low=clip_low, **kw))
    args = _args(data)
    losses = [
        fusedhead.fused_policy_loss(**args, clip_low=c, backend=backend).loss
        for c in (clip_low, 1.0, 0.2)
    ]
    assert torch.equal(losses[0], losses[1]), "past 1 the lower bound binds nothing more"
    assert not torch.equal(losses[0], losses[2]), "the lower clip at 0.8 must bind in this case"


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("device", "dtype"),
    [
        ("cpu", torch.float32),
        ("cpu", torch.float16),
        pytest.param("cuda", torch.bfloat16, marks=[pytest.mark.gpu, _CUDA]),
        pytest.param("cuda", torch.float16, marks=[pytest.mark.gpu, _CUDA]),
    ],
)
@pytest.mark.parametrize("extras", ["plain", "per-token temperature and softcap"])
def test_triton_policy_log_probs_are_fused_heads_bits(
    device: str, dtype: torch.dtype, extras: str
) -> None:
    """The triton policy loss scores each row as the plain head does (its logits kernel keeps the
    head's tiles and the head's fixed-order combine): its log-probs and entropies are
    ``fused_head``'s bits. So old log-probs from ``fused_head`` (verl's compute_log_prob) give a
    ratio of exactly 1 on the first on-policy step, where a clip range of 0 or the abs KL at
    ref == actor would otherwise see a rounding's difference."""
    g = torch.Generator().manual_seed(3)
    n, h, v = 77, 64, 1000
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=g) / 8).to(device=device, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    labels[::7] = -100
    kw: dict[str, Any] = {"temperature": 0.7}
    if extras != "plain":
        kw = {"temperature": (0.5 + torch.rand(n, generator=g)).to(device), "softcap": 3.0}
    plain = fusedhead.fused_head(hidden, weight, labels, backend="triton", **kw)
    out = fusedhead.fused_policy_loss(
        hidden.clone().requires_grad_(),
        weight.clone().requires_grad_(),
        labels,
        old_log_probs=plain.log_probs.detach().float(),
        advantages=torch.randn(n, generator=g).to(device),
        backend="triton",
        **kw,
    )
    assert torch.equal(out.log_probs, plain.log_probs.float())
    assert plain.entropy is not None
    assert torch.equal(out.entropy, plain.entropy.float())
    assert float(out.ratio_max) == 1.0 and float(out.ratio_min) == 1.0


@pytest.mark.parametrize("shift", [25.0, -25.0])
def test_the_tis_log_ratio_is_clamped_at_20_as_verls(shift: float) -> None:
    """verl's token TIS weight is exp of ``old - rollout`` clamped to [-20, 20] (its
    ``SAFETY_BOUND``): a rollout 25 nats away weighs as one 20 away, not 0 (or e^25)."""
    b = batch()
    common = {k: b[k] for k in ("hidden", "weight", "labels", "old_log_probs", "advantages")}

    def loss(offset: float) -> torch.Tensor:
        out = fusedhead.fused_policy_loss(
            **common, rollout_log_probs=b["old_log_probs"] + offset, tis_cap=1e12
        )
        return out.loss.detach()

    at_bound = loss(math.copysign(20.0, shift))
    assert at_bound != 0
    assert torch.equal(loss(shift), at_bound)
    assert torch.equal(loss(shift * 4), at_bound)


def test_a_masked_rollout_token_still_weighs_exactly_zero() -> None:
    """+inf rollout log-probs (IcePop masks) keep a weight of exactly 0 under verl's +-20 clamp
    (which alone would give e^-20): with the advantage only on masked tokens, no loss at all."""
    b = batch()
    rollout = b["old_log_probs"].clone()
    rollout[1, 2:5] = math.inf
    advantages = torch.zeros(3, 7)
    advantages[1, 2:5] = 3.0
    hidden = b["hidden"].clone().requires_grad_()
    out = fusedhead.fused_policy_loss(
        hidden,
        b["weight"],
        b["labels"],
        old_log_probs=b["old_log_probs"],
        advantages=advantages,
        rollout_log_probs=rollout,
        tis_cap=2.0,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert hidden.grad is not None and not hidden.grad.any()


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("shape", [(3, 4), (3, 0)], ids=["every-row-ignored", "no-token"])
def test_the_reference_gives_zero_where_no_token_is_scored(
    aggregation: str, shape: tuple[int, int]
) -> None:
    """The float64 yardstick agrees with the fused call where nothing is scored: loss 0, zero
    gradients (it gave 0 / 0 = NaN under token-mean, and crashed on ``[B, 0]`` labels)."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(*shape, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(17, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.full(shape, -100)
    kw: dict[str, Any] = {
        "old_log_probs": torch.zeros(shape),
        "advantages": torch.ones(shape),
        "aggregation": aggregation,
        "entropy_coef": 0.01,
    }
    ref = reference_policy_loss(h, w, labels, **kw)
    ref.backward()
    assert ref.item() == 0.0
    assert h.grad is not None and w.grad is not None
    assert not bool(h.grad.any()) and not bool(w.grad.any())
    out = fusedhead.fused_policy_loss(h.detach().float(), w.detach().float(), labels, **kw)
    assert out.loss.item() == 0.0
