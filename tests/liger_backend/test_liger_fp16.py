"""fp16 through Liger's chunked path: finite wherever the values fit fp16, never silent NaN.

Liger keeps the scaled logits ``z / T`` (single process) and the logits' gradient ``dz`` in the
input dtype; fp16 ends at 65504. Below T = 1, where the logits' bound says ``z / T`` could
leave that range, the adapter runs the single-process path on fp32 copies (``_run.widen_fp16``),
and it hands Liger the upstream gradients in fp32, divided by a power of two where they would
push ``dz`` (or ``dz / T``) past fp16's range (``_run._upstream_scale``).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator

import pytest
import torch

from fusedhead.protocol import call_backend
from fusedhead.reference import reference_fused_head

pytest.importorskip(
    "fusedhead_liger",
    reason="the liger backend is not installed (pip install ./plugins/liger_backend)",
)
from fusedhead_liger import LigerBackend, LigerOptions, _run

IGNORE = -100
#: Relative L2 error of fp16 gradients against float64: a few fp16 ulps (2**-11 each) from the
#: rounding of dz and of the gradient itself (measured: 2e-4 to 7e-4).
FP16_GRAD_TOL = 2.0**-9


def fallback() -> LigerBackend:
    return LigerBackend(LigerOptions(implementation="fallback"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def inputs(n: int, h: int, v: int, scale: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).half()
    weight = (torch.randn(v, h, generator=gen) * scale / h**0.5).half()
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[:3] = IGNORE
    return hidden, weight, labels


def step(backend, hidden, weight, labels, temperature, g_lp, g_ent, process_group=None):
    """Outputs and (dh, dw) of ``sum(g_lp * log_probs + g_ent * entropy)``."""
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = call_backend(backend,
        h, w, labels, temperature=temperature, ignore_index=IGNORE, return_entropy=True,
        process_group=process_group, vocab_start=0, vocab_size=weight.shape[0],
        reduce_hidden_grad=True,
    )  # fmt: skip
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp, ent, h.grad, w.grad


def reference(hidden, weight, labels, temperature, g_lp, g_ent):
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    lp, ent = reference_fused_head(
        h, w, labels, temperature=temperature, ignore_index=IGNORE, compute_dtype=torch.float64
    )
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp, ent, h.grad, w.grad


# ----------------------------------------------------------------------------- small temperatures


def test_fp16_small_temperature_is_finite_and_right() -> None:
    """Logits up to ~38 at T = 5e-4: z / T is ~77000, past fp16's 65504. Liger's fp16 division
    gave inf there, and NaN log-probs, entropy and gradients in those rows."""
    hidden, weight, labels = inputs(4, 64, 1000, scale=10.0)
    labels[:3] = labels[3]  # every row scored
    z = hidden.double() @ weight.double().T
    assert float(z.abs().max()) / 5e-4 > 65504  # the case: fp16 cannot hold z / T
    g_lp = torch.ones(4)
    lp, ent, dh, dw = step(fallback(), hidden, weight, labels, 5e-4, g_lp, torch.ones(4))
    rlp, rent, rdh, rdw = reference(hidden, weight, labels, 5e-4, g_lp, torch.ones(4))
    for t in (lp, ent, dh, dw):
        assert torch.isfinite(t).all()
    # fp32 logits of fp16-exact inputs: log-probs of ~1e5 to fp32's rounding of z / T
    assert rel(lp, rlp) < 1e-6
    assert (
        float((ent.detach().double() - rent.detach()).abs().max())
        < 2.0**-23 * float(z.abs().max()) / 5e-4 * 8
    )
    assert rel(dh, rdh) < FP16_GRAD_TOL and rel(dw, rdw) < FP16_GRAD_TOL


@pytest.mark.parametrize(
    ("scale", "temperature", "widened"),
    [
        (1.0, 0.7, False),  # usual logits: z / T far inside fp16, the fp16 path runs
        (1.0, 2.0**-20, True),  # the same logits at a tiny T could reach inf
        (20000.0, 0.999, True),  # logits whose bound passes half the range just below T = 1
    ],
)
def test_fp16_below_temperature_one_is_widened_only_where_the_logits_could_overflow(
    scale: float, temperature: float, widened: bool
) -> None:
    """fp32 copies cost five times fp16's time on a GPU: taken only where ``max |h| max |w| / T``,
    which no logit exceeds, passes half fp16's range."""
    hidden, weight, _ = inputs(4, 8, 16, scale)
    bound = _run.logit_bound(hidden, weight)
    assert (bound / temperature > _run.FP16_LOGIT_LIMIT) is widened  # the case
    h, w = _run.widen_fp16(hidden, weight, temperature)
    if widened:
        assert h.dtype == w.dtype == torch.float32
        assert torch.equal(h, hidden.float()) and torch.equal(w, weight.float())
    else:
        assert h is hidden and w is weight


@pytest.mark.parametrize("seed", range(4))
def test_the_logit_bound_is_never_below_a_logit(seed: int) -> None:
    hidden, weight, _ = inputs(32, 64, 500, 30.0, seed=seed)
    hidden[seed] *= 40  # one long row
    z = hidden.double() @ weight.double().T
    assert _run.logit_bound(hidden, weight) >= float(z.abs().max())


def test_a_non_finite_row_is_widened_and_no_rows_are_not() -> None:
    """A NaN or inf hidden row bounds nothing: the fp32 path keeps the other rows finite, as
    before. With no rows there is nothing to bound."""
    hidden, weight, _ = inputs(4, 8, 16, 1.0)
    for bad in (math.nan, math.inf):
        h = hidden.clone()
        h[1, 2] = bad
        assert _run.widen_fp16(h, weight, 0.7)[0].dtype == torch.float32
    empty = hidden[:0]
    assert _run.widen_fp16(empty, weight, 0.7)[0] is empty


def test_fp16_below_temperature_one_on_the_fp16_path_is_right() -> None:
    """Not widened at T = 0.7: fp16 log-probs, entropy and gradients against float64."""
    hidden, weight, labels = inputs(64, 32, 300, 4.0)
    assert _run.widen_fp16(hidden, weight, 0.7)[0] is hidden  # the case: the fp16 path
    g_lp, g_ent = torch.randn(64), torch.randn(64)
    lp, ent, dh, dw = step(fallback(), hidden, weight, labels, 0.7, g_lp, g_ent)
    rlp, rent, rdh, rdw = reference(hidden, weight, labels, 0.7, g_lp, g_ent)
    keep = labels.ne(IGNORE)
    assert rel(lp[keep], rlp[keep]) < 2.0**-9 and rel(ent[keep], rent[keep]) < 2.0**-9
    assert rel(dh, rdh) < FP16_GRAD_TOL and rel(dw, rdw) < FP16_GRAD_TOL


# ----------------------------------------------------------------------------- large upstream


def test_gradscaler_sized_entropy_gradient_stays_finite() -> None:
    """65536 (GradScaler's initial scale) on an entropy term: an fp16 entropy output made autograd
    round that upstream gradient to fp16 (inf), and every gradient was NaN. At T = 1 (no
    widening) the gradients fit fp16 and the torch backend's are finite."""
    from fusedhead_torch import TorchBackend

    hidden, weight, labels = inputs(64, 32, 300, 1.0)
    g_lp, g_ent = torch.zeros(64), torch.full((64,), 65536.0)
    *_, tdh, _ = step(TorchBackend(), hidden, weight, labels, 1.0, g_lp, g_ent)
    assert torch.isfinite(tdh).all()  # the case: the gradient fits fp16
    *_, dh, _ = step(fallback(), hidden, weight, labels, 1.0, g_lp, g_ent)
    *_, rdh, _ = reference(hidden, weight, labels, 1.0, g_lp, g_ent)
    assert torch.isfinite(dh).all()
    assert rel(dh, rdh) < FP16_GRAD_TOL


def test_fp16_path_below_temperature_one_keeps_dz_over_t_in_range() -> None:
    """Unwidened below T = 1, Liger rounds dz to fp16 and then divides it by T in fp16: 16000 on
    the log-probs at T = 0.2 is 80000 there (inf gradients) though the gradients, under 17000,
    fit. The upstream scale counts 1/T on this path too."""
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(4, 8, generator=gen) * 0.1).half()
    weight = (torch.randn(50, 8, generator=gen) * 0.1).half()
    labels = torch.randint(0, 50, (4,), generator=gen)
    g_lp, g_ent = torch.full((4,), 16000.0), torch.zeros(4)
    assert _run.widen_fp16(hidden, weight, 0.2)[0] is hidden  # the case: the fp16 path
    *_, rdh, rdw = reference(hidden, weight, labels, 0.2, g_lp, g_ent)
    assert max(float(rdh.abs().max()), float(rdw.abs().max())) < 65504  # the gradients fit
    *_, dh, dw = step(fallback(), hidden, weight, labels, 0.2, g_lp, g_ent)
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all()
    assert rel(dh, rdh) < FP16_GRAD_TOL and rel(dw, rdw) < FP16_GRAD_TOL


def test_normal_upstream_gradients_are_not_rescaled() -> None:
    """An upstream gradient whose dz fits fp16 reaches Liger as it is: scale 1, no host work."""
    g = torch.randn(64)
    assert _run._upstream_scale(g, g, math.log(300), 1.0, None, g.device) == 1.0
    assert _run._upstream_scale(None, None, math.log(300), 1.0, None, g.device) == 1.0


@pytest.mark.parametrize("inv_t", [1.0, 20.0])
def test_upstream_scale_puts_the_dz_bound_under_fp16s_range(inv_t: float) -> None:
    g_lp = torch.tensor([3.0, -70000.0, 1.0])
    g_ent = torch.tensor([0.5, 2.0, -90000.0])
    log_v = math.log(151936)
    s = _run._upstream_scale(g_lp, g_ent, log_v, inv_t, None, g_lp.device)
    bound = (70000.0 + 90000.0 * (0.5 + log_v)) * inv_t
    assert s == 2.0 ** round(math.log2(s)) and s > 1  # a power of two: exact to multiply back
    assert bound / s <= _run.DZ_TOP < 2 * bound / s  # the smallest that does
    assert _run._upstream_scale(torch.tensor([math.inf]), None, log_v, 1.0, None, g_lp.device) == 1


@pytest.fixture
def one_rank_group() -> Iterator[object]:
    """A gloo group of one process: Liger's vocabulary-parallel function, in this process."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rv", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_vocab_parallel_large_upstream_stays_finite(one_rank_group) -> None:
    """Liger's TP backward multiplies dz by 1/T before rounding it to fp16: 65536 on the entropy
    at T = 0.7 overflowed there (inf gradients) though the gradient, at most ~41600, fits."""
    hidden, weight, labels = inputs(64, 32, 300, 1.0)
    g_lp, g_ent = torch.zeros(64), torch.full((64,), 65536.0)
    _, ent, dh, _ = step(fallback(), hidden, weight, labels, 0.7, g_lp, g_ent, one_rank_group)
    _, rent, rdh, _ = reference(hidden, weight, labels, 0.7, g_lp, g_ent)
    assert float(rdh.abs().max()) < 65504  # the case: the true gradient fits fp16
    assert torch.isfinite(dh).all()
    assert rel(dh, rdh) < FP16_GRAD_TOL
    assert rel(ent, rent) < 2.0**-9  # the TP path's entropy is fp32 of fp16 logits
