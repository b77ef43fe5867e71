"""Forward and backward of the triton backend against float64, under the Triton interpreter.

Small fp32 and fp16 shapes with ragged H and V (tiles that hang over both), ignored rows,
temperature (float and per token), softcap, entropy off, partial requires_grad, several
backward vocabulary blocks, out-of-range labels, and the TMA path.
"""

from __future__ import annotations

import pytest
import torch
from triton_backend_helpers import (
    IGNORE,
    SMALL_TILES,
    assert_close,
    make_case,
    rel_err,
    run_reference,
    run_triton,
)

from fusedhead.protocol import call_backend
from fusedhead_triton import TritonBackend, TritonOptions

DTYPES = [torch.float32, torch.float16]
DTYPE_IDS = ["fp32", "fp16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    ("n", "h", "v", "options"),
    [
        (37, 100, 1000, None),  # shipped tiles: one row tile, V and H ragged
        (70, 72, 333, SMALL_TILES),  # 3 row tiles x 6 vocab tiles, every edge ragged
    ],
    ids=["shipped-tiles", "small-tiles"],
)
def test_matches_float64(n: int, h: int, v: int, options: dict | None, dtype: torch.dtype) -> None:
    case = make_case(n, h, v, seed=n)
    got = run_triton(case, dtype, options=options)
    assert_close(got, run_reference(case, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_several_backward_vocabulary_blocks(dtype: torch.dtype) -> None:
    """A dz budget far below one block: Vb = one tile, 6 blocks, the last one ragged."""
    case = make_case(40, 48, 333, seed=3)
    opts = {**SMALL_TILES, "backward_block_mib": 1e-4}
    assert_close(run_triton(case, dtype, options=opts), run_reference(case, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_tma_path_under_the_interpreter(dtype: torch.dtype) -> None:
    """H * itemsize a multiple of 16 bytes: the persistent TMA kernels run (forward and backward)."""
    case = make_case(45, 64, 200, seed=5)
    opts = {**SMALL_TILES, "tma": True, "backward_block_mib": 1e-4}
    assert_close(run_triton(case, dtype, options=opts), run_reference(case, dtype), dtype)


@pytest.mark.parametrize(
    ("temperature", "softcap"),
    [(1.0, None), (0.3, None), ("per-token", None), (0.7, 2.0), ("per-token", 1.5)],
    ids=["T1", "T0.3", "T-per-token", "softcap", "softcap-T-per-token"],
)
def test_temperature_and_softcap(temperature: float | str, softcap: float | None) -> None:
    case = make_case(50, 40, 300, seed=11, peak=4.0)
    if temperature == "per-token":
        temperature = torch.rand(50, generator=torch.Generator().manual_seed(1)) + 0.25
    got = run_triton(
        case, torch.float32, temperature=temperature, softcap=softcap, options=SMALL_TILES
    )
    want = run_reference(case, torch.float32, temperature=temperature, softcap=softcap)
    assert_close(got, want, torch.float32)


def test_without_entropy() -> None:
    case = make_case(33, 40, 300, seed=2)
    got = run_triton(case, torch.float32, entropy=False, options=SMALL_TILES)
    assert got.entropy is None
    assert_close(got, run_reference(case, torch.float32, entropy=False), torch.float32)


def test_only_the_log_prob_feeds_the_loss() -> None:
    """Entropy returned but unused: its upstream gradient is None, and skipped, not zero-filled."""
    case = make_case(33, 40, 300, seed=4)
    case.g_ent.zero_()
    got = run_triton(case, torch.float32, entropy=True, options=SMALL_TILES)
    assert_close(got, run_reference(case, torch.float32), torch.float32)


@pytest.mark.parametrize(("grad_hidden", "grad_weight"), [(True, False), (False, True)])
def test_partial_requires_grad(grad_hidden: bool, grad_weight: bool) -> None:
    case = make_case(30, 40, 200, seed=6)
    got = run_triton(
        case, torch.float32, grad_hidden=grad_hidden, grad_weight=grad_weight, options=SMALL_TILES
    )
    assert (got.d_hidden is not None) == grad_hidden
    assert (got.d_weight is not None) == grad_weight
    assert_close(got, run_reference(case, torch.float32), torch.float32)


def test_ignored_rows_give_zero_and_no_gradient() -> None:
    case = make_case(30, 40, 200, seed=7, ignore_every=3)
    got = run_triton(case, torch.float32, options=SMALL_TILES)
    ignored = case.labels == IGNORE
    assert torch.equal(got.log_probs[ignored], torch.zeros(int(ignored.sum())))
    assert torch.equal(got.entropy[ignored], torch.zeros(int(ignored.sum())))
    assert got.d_hidden[ignored].abs().max() == 0
    assert got.d_hidden[~ignored].abs().max() > 0


def test_out_of_range_labels_give_nan_rows_and_no_crash() -> None:
    """check_labels=False: labels past V or negative (not ignore_index) -> NaN log-prob there."""
    case = make_case(24, 40, 200, seed=8, ignore_every=0)
    labels = case.labels.clone()
    bad = torch.tensor([1, 5, 6, 20])
    labels[bad] = torch.tensor([200, 10**12, -1, -(10**12)])
    got = run_triton(case, torch.float32, labels=labels, options=SMALL_TILES, grad_weight=False)
    assert torch.isnan(got.log_probs[bad]).all()
    good = torch.ones(24, dtype=torch.bool)
    good[bad] = False
    want = run_reference(case, torch.float32)
    assert rel_err(got.log_probs[good], want.log_probs[good]) <= 1e-5
    assert rel_err(got.entropy, want.entropy) <= 1e-5  # entropy does not depend on the label
    assert torch.isfinite(got.d_hidden).all()


@pytest.mark.parametrize(("peak", "scale"), [(8.0, 1.0), (1.0, 60.0), (1.0, -60.0)])
def test_peaked_and_large_magnitude_logits(peak: float, scale: float) -> None:
    """Peaked rows, and logits in the hundreds (positive or all negative): still 1e-5."""
    case = make_case(30, 40, 300, seed=9, peak=peak)
    case.hidden *= abs(scale)
    if scale < 0:
        case.weight = -case.weight.abs()
        case.hidden = case.hidden.abs()
    got = run_triton(case, torch.float32, options=SMALL_TILES)
    want = run_reference(case, torch.float32)
    assert rel_err(got.log_probs, want.log_probs) <= 1e-5
    assert (got.entropy - want.entropy).abs().max() <= 1e-4
    assert (got.log_probs <= 0).all()


def test_single_row() -> None:
    case = make_case(1, 40, 300, seed=10, ignore_every=0)
    assert_close(
        run_triton(case, torch.float32, options=SMALL_TILES),
        run_reference(case, torch.float32),
        torch.float32,
    )


def test_temperature_tensor_that_requires_grad_is_refused() -> None:
    be = TritonBackend(TritonOptions())
    h = torch.randn(4, 16)
    w = torch.randn(32, 16)
    t = torch.ones(4, requires_grad=True)
    with pytest.raises(ValueError, match="temperature"):
        call_backend(be,
            h, w, torch.zeros(4, dtype=torch.long), temperature=t, ignore_index=IGNORE,
            return_entropy=True, process_group=None, vocab_start=0, vocab_size=32,
            reduce_hidden_grad=True,
        )  # fmt: skip
