"""The torch backend computes the contract's numbers: outputs and gradients against float64."""

from __future__ import annotations

import math

import pytest
import torch
from torch_backend_helpers import (
    DTYPES,
    IGNORE,
    Result,
    assert_close,
    make_case,
    rel_err,
    run_backend,
    run_reference,
)

from fusedhead.protocol import call_backend
from fusedhead_torch import TorchBackend, TorchOptions

#: Small tiles whose sizes divide neither N nor V, so every loop has a ragged last tile.
RAGGED = TorchOptions(chunk_rows=10, block_vocab=16)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("options", [RAGGED, TorchOptions()], ids=["ragged", "default"])
def test_matches_float64_reference(dtype: str, options: TorchOptions) -> None:
    case = make_case(37, 24, 101)
    got = run_backend(case, dtype=DTYPES[dtype], options=options)
    assert_close(got, run_reference(case, dtype=DTYPES[dtype]), dtype)


@pytest.mark.parametrize("peak", [1.0, 4.0], ids=["flat", "peaked"])
def test_fp32_within_1e5_of_float64_on_a_wider_vocabulary(peak: float) -> None:
    case = make_case(64, 96, 1500, peak=peak)
    got = run_backend(case, options=TorchOptions(block_vocab=512))
    want = run_reference(case)
    assert rel_err(got.log_probs, want.log_probs) <= 1e-5
    assert rel_err(got.entropy, want.entropy) <= 1e-5


@pytest.mark.parametrize("temperature", [0.05, 0.3, 1.0, 5.0, 20.0])
def test_temperatures(temperature: float) -> None:
    case = make_case(29, 16, 70)
    got = run_backend(case, options=RAGGED, temperature=temperature)
    assert_close(got, run_reference(case, temperature=temperature), "fp32", f"T={temperature}")


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_per_token_temperature(dtype: str) -> None:
    case = make_case(33, 16, 70)
    g = torch.Generator().manual_seed(1)
    temps = torch.exp(torch.empty(33).uniform_(math.log(0.05), math.log(20.0), generator=g))
    got = run_backend(case, dtype=DTYPES[dtype], options=RAGGED, temperature=temps)
    assert_close(got, run_reference(case, dtype=DTYPES[dtype], temperature=temps), dtype)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("per_token", [False, True], ids=["scalar-T", "per-token-T"])
def test_softcap_applies_before_temperature(dtype: str, per_token: bool) -> None:
    case = make_case(31, 16, 70, peak=8.0)
    temps = torch.linspace(0.3, 3.0, 31) if per_token else 0.7
    got = run_backend(case, dtype=DTYPES[dtype], options=RAGGED, temperature=temps, softcap=2.5)
    want = run_reference(case, dtype=DTYPES[dtype], temperature=temps, softcap=2.5)
    assert_close(got, want, dtype)
    uncapped = run_reference(case, dtype=DTYPES[dtype], temperature=temps)
    assert rel_err(got.log_probs, uncapped.log_probs) > 1e-2  # the cap did something


def test_return_entropy_false_gives_none_and_log_prob_gradients() -> None:
    case = make_case(25, 16, 50)
    got = run_backend(case, options=RAGGED, return_entropy=False)
    assert got.entropy is None
    assert_close(got, run_reference(case, return_entropy=False), "fp32")


def test_ignored_rows_give_zero_and_no_gradient() -> None:
    case = make_case(30, 16, 50, ignore_every=3)
    got = run_backend(case, options=RAGGED)
    ignored = case.labels == IGNORE
    assert torch.equal(got.log_probs[ignored], torch.zeros(int(ignored.sum())))
    assert torch.equal(got.entropy[ignored], torch.zeros(int(ignored.sum())))
    assert torch.equal(got.d_hidden[ignored], torch.zeros_like(got.d_hidden[ignored]))
    assert (got.log_probs[~ignored] < 0).all() and (got.entropy[~ignored] > 0).all()
    assert_close(got, run_reference(case), "fp32")


@pytest.mark.parametrize("skip", [False, True], ids=["computed", "skipped"])
def test_all_rows_ignored_gives_zero_gradients(skip: bool) -> None:
    case = make_case(12, 8, 20)
    case.labels[:] = IGNORE
    got = run_backend(case, options=TorchOptions(block_vocab=16, skip_ignored_rows=skip))
    assert not got.log_probs.any() and not got.entropy.any()
    assert not got.d_hidden.any() and not got.d_weight.any()


@pytest.mark.parametrize("temperature", [0.7, "per-token"])
def test_skipping_ignored_rows_changes_nothing_beyond_rounding(temperature: object) -> None:
    case = make_case(45, 16, 90, ignore_every=4)
    temp = torch.linspace(0.3, 3.0, 45) if temperature == "per-token" else 0.7
    results = [
        run_backend(
            case, options=TorchOptions(block_vocab=32, skip_ignored_rows=skip), temperature=temp
        )
        for skip in (False, True)
    ]
    a, b = results
    for x, y in zip(
        (a.log_probs, a.entropy, a.d_hidden, a.d_weight),
        (b.log_probs, b.entropy, b.d_hidden, b.d_weight),
    ):
        assert rel_err(x, y) <= 2e-6


@pytest.mark.parametrize(
    ("grad_hidden", "grad_weight"), [(True, False), (False, True)], ids=["hidden", "weight"]
)
def test_gradient_only_for_the_input_that_requires_it(grad_hidden: bool, grad_weight: bool) -> None:
    case = make_case(21, 16, 40)
    got = run_backend(case, options=RAGGED, grad_hidden=grad_hidden, grad_weight=grad_weight)
    assert (got.d_hidden is not None) == grad_hidden
    assert (got.d_weight is not None) == grad_weight
    assert_close(got, run_reference(case), "fp32")


def test_no_input_requires_grad_gives_plain_outputs() -> None:
    case = make_case(21, 16, 40)
    got = run_backend(case, options=RAGGED, grad_hidden=False, grad_weight=False)
    assert not got.log_probs.requires_grad
    assert_close(got, run_reference(case), "fp32")


def test_gradients_have_the_input_dtype() -> None:
    case = make_case(9, 8, 30)
    got = run_backend(case, dtype=torch.bfloat16, options=RAGGED)
    assert got.d_hidden.dtype == torch.bfloat16 and got.d_weight.dtype == torch.bfloat16


@pytest.mark.parametrize("scale", [30.0, 300.0])
def test_large_magnitude_logits(scale: float) -> None:
    case = make_case(27, 32, 90, peak=scale)
    got = run_backend(case, options=RAGGED)
    want = run_reference(case)
    assert torch.isfinite(got.log_probs).all() and torch.isfinite(got.d_weight).all()
    assert rel_err(got.log_probs, want.log_probs) <= 1e-5
    assert rel_err(got.d_hidden, want.d_hidden) <= 1e-5
    assert rel_err(got.d_weight, want.d_weight) <= 1e-5
    # Rows this peaked have entropy near 0, so its relative error says little; an fp32 logit of
    # size |z| is off by about u|z| (u = 2^-24), and so is the entropy, at most a few times that.
    zmax = float((case.hidden @ case.weight.T).abs().max() / 0.7)
    assert float((got.entropy - want.entropy).abs().max()) <= 4 * 2.0**-24 * (1 + zmax)


def test_all_negative_logits() -> None:
    case = make_case(27, 32, 90, peak=3.0)
    case.hidden.abs_()
    case.weight.copy_(-case.weight.abs() - 0.5)
    got = run_backend(case, options=RAGGED)
    assert_close(got, run_reference(case), "fp32")


def test_non_contiguous_hidden() -> None:
    case = make_case(20, 16, 40)
    wide = torch.zeros(20, 32, dtype=torch.float64)
    wide[:, ::2] = case.hidden
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    got = run_backend(case, options=RAGGED, hidden=strided)
    assert_close(got, run_reference(case), "fp32")


def test_out_of_range_labels_give_nan_rows_and_never_index_out_of_bounds() -> None:
    case = make_case(24, 16, 40)
    bad = torch.tensor([2, 5, 11, 17])
    case.labels[bad] = torch.tensor([40, -3, 10_000, 41])
    got = run_backend(case, options=RAGGED)
    assert torch.isnan(got.log_probs[bad]).all()
    good = torch.ones(24, dtype=torch.bool)
    good[bad] = False
    assert torch.isfinite(got.log_probs[good]).all()
    masked = case.labels.clone()
    masked[bad] = IGNORE
    want = run_reference(case, labels=masked)
    assert rel_err(got.log_probs[good], want.log_probs[good]) <= 1e-5
    # The caller's loss skips NaN rows (nansum): their entropy term still flows, like the
    # reference's rows whose label is ignored but whose entropy is kept.
    assert torch.isfinite(got.d_hidden).all() and torch.isfinite(got.d_weight).all()


def test_backward_under_autocast_keeps_the_input_precision() -> None:
    case = make_case(30, 16, 60)
    h = case.hidden.float().requires_grad_()
    w = case.weight.float().requires_grad_()
    lp, ent = call_backend(
        TorchBackend(RAGGED),
        h,
        w,
        case.labels,
        temperature=0.7,
        ignore_index=IGNORE,
        return_entropy=True,
        process_group=None,
        vocab_start=0,
        vocab_size=60,
        reduce_hidden_grad=True,
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ((lp.double() * case.g_lp).sum() + (ent.double() * case.g_ent).sum()).backward()
    got = Result(lp.detach(), ent.detach(), h.grad, w.grad)
    assert h.grad.dtype == torch.float32
    assert_close(got, run_reference(case), "fp32", "backward under autocast")


def test_deterministic_bits_run_to_run() -> None:
    case = make_case(40, 32, 130)
    a = run_backend(case, options=RAGGED)
    b = run_backend(case, options=RAGGED)
    for x, y in zip(
        (a.log_probs, a.entropy, a.d_hidden, a.d_weight),
        (b.log_probs, b.entropy, b.d_hidden, b.d_weight),
    ):
        assert torch.equal(x, y)


def test_tiling_changes_nothing_beyond_rounding() -> None:
    case = make_case(50, 24, 300)
    one = run_backend(case, options=TorchOptions(chunk_rows=50, block_vocab=300))
    many = run_backend(case, options=TorchOptions(chunk_rows=7, block_vocab=33))
    for x, y in zip(
        (one.log_probs, one.entropy, one.d_hidden, one.d_weight),
        (many.log_probs, many.entropy, many.d_hidden, many.d_weight),
    ):
        assert rel_err(x, y) <= 2e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("feature", ["plain", "per-token-T", "softcap", "no-entropy"])
def test_cuda_matches_float64_reference(dtype: str, feature: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    case = make_case(300, 64, 1000, peak=4.0 if feature == "softcap" else 1.0)
    kwargs: dict = {}
    if feature == "per-token-T":
        kwargs["temperature"] = torch.linspace(0.1, 5.0, 300)
    if feature == "softcap":
        kwargs["softcap"] = 3.0
    if feature == "no-entropy":
        kwargs["return_entropy"] = False
    # "plain" also chunks rows, so a block's weight gradient sums row chunks in fp32.
    rows = 128 if feature == "plain" else None
    options = TorchOptions(block_vocab=256, chunk_rows=rows)
    got = run_backend(case, dtype=DTYPES[dtype], device="cuda", options=options, **kwargs)
    assert_close(got, run_reference(case, dtype=DTYPES[dtype], **kwargs), dtype, feature)
