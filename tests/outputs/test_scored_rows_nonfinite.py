"""A scored row whose scaled logits are all NaN (a NaN in its hidden state, or a NaN per-token
temperature handed over unchecked with ``check_labels=False``) has no most likely id: its argmax
and top-k ids read -1, the id an ignored row reads, on every first-party backend; its log-probs
are NaN, and no other row changes.

Before: the torch backend ranked such a row by NaN's sort order (or by its raw logits, past a NaN
temperature) and returned ids in ``[0, V)`` that looked valid, so ``out.argmax == labels``
could count the NaN row as a correct token; the triton backend already read -1.
"""

from __future__ import annotations

import pytest
import torch

from fusedhead import fused_head

N, H, V, K = 6, 16, 40, 3
#: Scored rows without a ranking, and what makes them so.
NO_MAX = {1: "nan-row", 2: "one-nan", 4: "nan-temperature"}
CASES = {
    "torch-skip-rows": ("torch", {"skip_ignored_rows": True}),
    "torch-all-rows": ("torch", {"skip_ignored_rows": False}),
    "torch-tiled": ("torch", {"skip_ignored_rows": False, "block_vocab": 16, "chunk_rows": 4}),
    "triton": ("triton", {"block_m": 16, "block_n": 16, "block_k": 16}),
}


def _inputs(poison: bool):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / 4
    labels = torch.randint(0, V, (N,), generator=g)
    labels[5] = -100
    temperature = torch.rand(N, generator=g) + 0.5
    if poison:
        hidden[1] = float("nan")
        hidden[2, 3] = float("nan")
        temperature[4] = float("nan")
    return hidden, weight, labels, temperature


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["no-softcap", "softcap"])
@pytest.mark.parametrize(("backend", "options"), list(CASES.values()), ids=list(CASES))
def test_a_scored_row_without_a_max_logit_has_no_ids(backend, options, softcap):
    def run(poison: bool):
        h, w, y, t = _inputs(poison)
        return fused_head(
            h, w, y, temperature=t, softcap=softcap, check_labels=False, return_argmax=True,
            top_k=K, backend=backend, options=options,
        )  # fmt: skip

    out, clean = run(True), run(False)
    bad = list(NO_MAX)
    assert out.argmax[bad].tolist() == [-1] * len(bad)
    assert out.topk_ids[bad].tolist() == [[-1] * K] * len(bad)
    assert bool(out.log_probs[bad].isnan().all())
    good = [i for i in range(N) if i not in NO_MAX]
    assert torch.equal(out.argmax[good], clean.argmax[good])
    assert torch.equal(out.topk_ids[good], clean.topk_ids[good])
    assert out.argmax[5] == -1 and 0 <= int(clean.argmax[0]) < V


@pytest.mark.parametrize("poison", ["nan-weight-row", "inf-hidden-row", "overflowing-row"])
def test_a_row_with_a_nan_or_infinite_logit_has_no_ids_on_every_backend(poison):
    """A NaN weight row gives every row one NaN logit; a hidden row of +inf gives its row NaN and
    infinite logits; a row of 1e36 at T = 1e-3 overflows to infinite scaled logits and no NaN.
    Each such row's log-probs are NaN and its ids -1 on both backends. Before, triton ranked the
    other columns (and named the +inf column), torch read -1; the overflowing row kept its ids on
    triton even after that (a tile whose max is +inf summed to 0, not NaN)."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / 4
    labels = torch.randint(0, V, (N,), generator=g)
    if poison == "nan-weight-row":
        weight[7] = float("nan")
        bad = list(range(N))
    elif poison == "inf-hidden-row":
        hidden[2] = float("inf")
        bad = [2]
    else:
        hidden[2] *= 1e36
        bad = [2]
    temperature = 1e-3 if poison == "overflowing-row" else 1.0
    for backend, options in CASES.values():
        out = fused_head(
            hidden, weight, labels, return_argmax=True, top_k=K, backend=backend,
            options=options, check_labels=False, temperature=temperature,
        )  # fmt: skip
        if poison == "overflowing-row":
            z = hidden.double() @ weight.double().T / temperature
            assert bool(z[2].float().isinf().any()) and not bool(z[2].isnan().any())
        assert out.argmax[bad].tolist() == [-1] * len(bad), (backend, out.argmax.tolist())
        assert out.topk_ids[bad].tolist() == [[-1] * K] * len(bad), backend
        assert bool(out.log_probs[bad].isnan().all()), backend


@pytest.mark.parametrize("vocab", [1, 13, 16, 40])
@pytest.mark.parametrize("poison", ["nan-row", "nan-temperature", "minus-inf-row"])
def test_a_scored_row_without_a_finite_logit_has_nan_statistics_at_any_vocabulary(vocab, poison):
    """lse, entropy and the sum of squared p of such a row are NaN, as its log-prob is, on every
    backend, whether or not the vocabulary fills a tile. Before, triton gave lse = -inf (an empty
    distribution, a z-loss of inf) where the whole vocabulary sat in one tile with padding
    columns: that tile's max passed over the NaN, and a row with no live tile summed s = 0."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(vocab, H, generator=g) / 4
    labels = torch.randint(0, vocab, (N,), generator=g)
    temperature = torch.rand(N, generator=g) + 0.5
    if poison == "nan-row":
        hidden[1] = float("nan")
    elif poison == "nan-temperature":
        temperature[1] = float("nan")
    else:
        hidden[1] = float("-inf")
    for backend, options in CASES.values():
        out = fused_head(
            hidden, weight, labels, temperature=temperature, return_lse=True, return_sum_p2=True,
            backend=backend, options=options, check_labels=False,
        )  # fmt: skip
        for name in ("log_probs", "entropy", "lse", "sum_p2"):
            value = getattr(out, name)[1]
            assert bool(value.isnan()), (backend, name, float(value))
        assert bool(out.lse[[0, 2, 3, 4, 5]].isfinite().all()), backend
