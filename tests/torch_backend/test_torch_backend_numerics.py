"""The torch backend's numerics at the edges: fp32 logits from bf16/fp16 inputs, tiny and huge
temperatures, and ignored rows whose hidden state holds NaN (all against float64)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch_backend_helpers import (
    DTYPES,
    IGNORE,
    TOLERANCE,
    Case,
    Result,
    assert_close,
    make_case,
    rel_err,
    run_backend,
    run_reference,
)

import fusedhead
from fusedhead_torch import TorchBackend, TorchOptions

RAGGED = TorchOptions(chunk_rows=10, block_vocab=16)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


# --- fp32 logits from bf16/fp16 inputs ----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(
    "feature", ["plain", "per-token-T", "softcap", "no-entropy", "ragged", "peaked"]
)
def test_fp32_logits_within_1e5_of_float64_on_the_same_values(dtype: str, feature: str) -> None:
    case = make_case(64, 96, 1500, peak=4.0 if feature in ("peaked", "softcap") else 1.0)
    kwargs: dict = {}
    if feature == "per-token-T":
        kwargs["temperature"] = torch.linspace(0.2, 3.0, 64)
    if feature == "softcap":
        kwargs["softcap"] = 3.0
    if feature == "no-entropy":
        kwargs["return_entropy"] = False
    rows = 20 if feature == "ragged" else None
    options = TorchOptions(block_vocab=400, chunk_rows=rows)  # 4 blocks, the last one ragged
    got = run_backend(case, dtype=DTYPES[dtype], options=options, **kwargs)
    want = run_reference(case, dtype=DTYPES[dtype], **kwargs)
    assert rel_err(got.log_probs, want.log_probs) <= 1e-5
    assert float((got.log_probs - want.log_probs).abs().max()) <= 1e-5 * (
        1 + float(want.log_probs.abs().max())
    )
    if want.entropy is not None:
        assert rel_err(got.entropy, want.entropy) <= 1e-5
        assert float((got.entropy - want.entropy).abs().max()) <= 1e-5 * (
            1 + float(want.entropy.abs().max())
        )
    # Gradients come back in the input dtype: within its bounds.
    assert rel_err(got.d_hidden, want.d_hidden) <= TOLERANCE[dtype][1]
    assert rel_err(got.d_weight, want.d_weight) <= TOLERANCE[dtype][1]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_input_dtype_logits_are_the_coarser_option(dtype: str) -> None:
    case = make_case(64, 96, 1500)
    want = run_reference(case, dtype=DTYPES[dtype])
    coarse = run_backend(case, dtype=DTYPES[dtype], options=TorchOptions(fp32_logits=False))
    fine = run_backend(case, dtype=DTYPES[dtype], options=TorchOptions())
    # The rounding of the logits to the input dtype is what the default removes.
    assert rel_err(coarse.log_probs, want.log_probs) > 10 * rel_err(fine.log_probs, want.log_probs)
    assert_close(coarse, want, dtype, "input-dtype logits")


@pytest.mark.parametrize(
    ("fp32_logits", "precision"), [(None, "fp32"), (True, "fp32"), (False, "bf16")]
)
def test_capabilities_declare_the_logits_precision(
    fp32_logits: bool | None, precision: str
) -> None:
    backend = TorchBackend(TorchOptions(fp32_logits=fp32_logits))
    for device in ("cpu", "cuda"):
        assert backend.capabilities(torch.device(device)).logits_precision == precision


def test_fp32_inputs_are_unchanged_by_the_option() -> None:
    case = make_case(37, 24, 101)
    a = run_backend(case, options=TorchOptions(block_vocab=16, fp32_logits=True))
    b = run_backend(case, options=TorchOptions(block_vocab=16, fp32_logits=False))
    for x, y in zip(
        (a.log_probs, a.entropy, a.d_hidden, a.d_weight),
        (b.log_probs, b.entropy, b.d_hidden, b.d_weight),
    ):
        assert torch.equal(x, y)


def test_the_smoke_run_of_the_measuring_tool(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import importlib.util
    import json
    from pathlib import Path

    tool = Path(__file__).parents[2] / "plugins/torch_backend/tools/logits_precision.py"
    spec = importlib.util.spec_from_file_location("logits_precision", tool)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main([str(tmp_path), "--small"])
    saved = json.loads((tmp_path / "logits_precision.json").read_text())
    assert saved["shape"] == result["shape"] == {**module.SMALL, "dtype": "bf16", "T": 0.7}
    coarse, fine = saved["paths"]["bf16_logits"], saved["paths"]["fp32_logits"]
    for row in (coarse, fine):
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0  # times only: no timing relation
        assert row["peak_extra_gib"] is None or row["peak_extra_gib"] >= 0
    assert fine["log_prob_rel_err"] <= 1e-5 and fine["entropy_rel_err"] <= 1e-5
    assert coarse["log_prob_max_abs"] > 10 * fine["log_prob_max_abs"]


# --- tiny and huge temperatures -----------------------------------------------------------------

#: Scales 1 / T far from 1: z = x / T up to ~1e26, and down to ~1e-26 (a uniform softmax).
EXTREME_T = [1e-25, 1e-10, 1e-4, 1e4, 1e10, 1e25]


def _assert_extreme_close(got: Result, want: Result, dtype: str, what: str) -> None:
    """Like ``assert_close``, but entropy against an absolute bound: at tiny T it is ~0."""
    out_tol, grad_tol = TOLERANCE[dtype]
    for name, a, b in (("log_probs", got.log_probs, want.log_probs),):
        assert torch.isfinite(a).all(), f"{what} {name} not finite"
        assert rel_err(a, b) <= out_tol, f"{what} {name}: {rel_err(a, b):.3g}"
    if want.entropy is not None:
        assert got.entropy is not None and torch.isfinite(got.entropy).all(), what
        err = float((got.entropy - want.entropy).abs().max())
        assert err <= out_tol * (1 + float(want.entropy.abs().max())), f"{what} entropy: {err:.3g}"
    for name, a, b in (
        ("d_hidden", got.d_hidden, want.d_hidden),
        ("d_weight", got.d_weight, want.d_weight),
    ):
        assert a is not None and b is not None
        assert torch.isfinite(a).all(), f"{what} {name} not finite"
        assert rel_err(a, b) <= grad_tol, f"{what} {name}: {rel_err(a, b):.3g}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 2.5], ids=["no-cap", "softcap"])
@pytest.mark.parametrize("temperature", EXTREME_T)
def test_extreme_temperatures_forward_and_backward(
    dtype: str, softcap: float | None, temperature: float
) -> None:
    case = make_case(29, 16, 70)
    got = run_backend(
        case, dtype=DTYPES[dtype], options=RAGGED, temperature=temperature, softcap=softcap
    )
    want = run_reference(case, dtype=DTYPES[dtype], temperature=temperature, softcap=softcap)
    _assert_extreme_close(got, want, dtype, f"T={temperature:g} softcap={softcap}")


@pytest.mark.parametrize("softcap", [None, 2.5], ids=["no-cap", "softcap"])
def test_extreme_per_token_temperatures(softcap: float | None) -> None:
    case = make_case(36, 16, 70)
    temps = torch.tensor([*EXTREME_T, 0.7]).repeat(6)[:36]
    got = run_backend(case, options=RAGGED, temperature=temps, softcap=softcap)
    want = run_reference(case, temperature=temps, softcap=softcap)
    # Each row on its own scale: compare row by row, relative to that row's size.
    assert torch.isfinite(got.log_probs).all() and torch.isfinite(got.entropy).all()
    scale = want.log_probs.abs().clamp_min(1.0)
    assert float(((got.log_probs - want.log_probs).abs() / scale).max()) <= 1e-5
    assert float((got.entropy - want.entropy).abs().max()) <= 1e-5 * math.log(70)
    assert torch.isfinite(got.d_hidden).all() and torch.isfinite(got.d_weight).all()
    # dh rows are independent: each row within the bound of its own size.
    row_err = (got.d_hidden - want.d_hidden).norm(dim=1) / want.d_hidden.norm(dim=1).clamp_min(
        1e-300
    )
    kept = case.labels != IGNORE
    assert float(row_err[kept].max()) <= 1e-5


def test_the_g_chain_at_tiny_temperature_is_finite_with_entropy_only() -> None:
    case = make_case(29, 16, 70)
    case.g_lp.zero_()  # only the entropy term flows: b * d alone would overflow, e * d does not
    got = run_backend(case, options=RAGGED, temperature=1e-25)
    assert torch.isfinite(got.d_hidden).all() and torch.isfinite(got.d_weight).all()
    want = run_reference(case, temperature=1e-25)
    assert float(got.d_hidden.abs().max()) <= 1e-5 * (1 + float(want.d_hidden.abs().max()))


@pytest.mark.parametrize("softcap", [None, 2.5], ids=["no-cap", "softcap"])
def test_beyond_the_scale_cap_gives_the_limits_not_nan(softcap: float | None) -> None:
    case = make_case(29, 16, 70)
    kept = case.labels != IGNORE
    z = (case.hidden.float() @ case.weight.float().T).double()
    is_argmax = z.argmax(dim=1) == case.labels.clamp(min=0)
    # T -> 0: a one-hot softmax. Argmax labels get log p = 0, others a huge negative value.
    tiny = run_backend(case, options=RAGGED, temperature=1e-300, softcap=softcap)
    assert not tiny.log_probs.isnan().any() and not tiny.entropy.isnan().any()
    assert torch.equal(tiny.log_probs[kept & is_argmax], torch.zeros(int((kept & is_argmax).sum())))
    assert (tiny.log_probs[kept & ~is_argmax] < -1e20).all()
    assert torch.equal(tiny.entropy, torch.zeros(29))
    assert not tiny.d_hidden.isnan().any() and not tiny.d_weight.isnan().any()
    # T -> infinity: a uniform softmax, no gradient left.
    huge = run_backend(case, options=RAGGED, temperature=1e300, softcap=softcap)
    uniform = torch.full((int(kept.sum()),), -math.log(70))
    assert torch.allclose(huge.log_probs[kept], uniform, rtol=1e-6, atol=0)
    assert torch.allclose(huge.entropy[kept], -uniform, rtol=1e-6, atol=0)
    assert not huge.d_hidden.any() and not huge.d_weight.any()


# --- an ignored row whose hidden state holds NaN ------------------------------------------------


def _with_nan_rows(case: Case, value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's hidden with every ignored row set to ``value``, and that mask."""
    ignored = case.labels == IGNORE
    hidden = case.hidden.clone()
    hidden[ignored] = value
    return hidden, ignored


SKIP = [
    pytest.param(False, id="all-rows"),  # the CUDA default
    pytest.param(True, id="skip-ignored"),  # the CPU default
]


@pytest.mark.parametrize("skip", SKIP)
@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no-entropy"])
@pytest.mark.parametrize("feature", ["plain", "per-token-T", "softcap", "one-tile"])
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_nan_hidden_in_an_ignored_row_gives_exactly_zero_gradients(
    skip: bool, entropy: bool, feature: str, value: float
) -> None:
    case = make_case(30, 16, 50, ignore_every=3)
    hidden, ignored = _with_nan_rows(case, value)
    kwargs: dict = {"return_entropy": entropy}
    if feature == "per-token-T":
        kwargs["temperature"] = torch.linspace(0.3, 3.0, 30)
    if feature == "softcap":
        kwargs["softcap"] = 2.0
    tiles = {} if feature == "one-tile" else {"chunk_rows": 10, "block_vocab": 16}
    options = TorchOptions(skip_ignored_rows=skip, **tiles)
    got = run_backend(case, options=options, hidden=hidden, **kwargs)
    assert torch.equal(got.d_hidden[ignored], torch.zeros(int(ignored.sum()), 16))
    assert torch.isfinite(got.d_hidden).all() and torch.isfinite(got.d_weight).all()
    assert torch.equal(got.log_probs[ignored], torch.zeros(int(ignored.sum())))
    if entropy:
        assert torch.equal(got.entropy[ignored], torch.zeros(int(ignored.sum())))
    # The weight gradient does not see the row: the same bits as with a finite hidden there.
    clean = run_backend(case, options=options, **kwargs)
    assert torch.equal(got.d_weight, clean.d_weight)
    assert torch.equal(got.d_hidden, clean.d_hidden)
    assert_close(got, run_reference(case, **kwargs), "fp32", "NaN in ignored rows")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("fp32_logits", [True, False], ids=["fp32-logits", "input-logits"])
def test_nan_hidden_in_an_ignored_row_in_low_precision(dtype: str, fp32_logits: bool) -> None:
    case = make_case(30, 16, 50, ignore_every=3)
    hidden, ignored = _with_nan_rows(case, math.nan)
    options = TorchOptions(
        skip_ignored_rows=False, fp32_logits=fp32_logits, **RAGGED.model_dump(exclude_none=True)
    )
    got = run_backend(case, dtype=DTYPES[dtype], options=options, hidden=hidden)
    assert not got.d_hidden[ignored].any() and torch.isfinite(got.d_hidden).all()
    assert torch.isfinite(got.d_weight).all()
    clean = run_backend(case, dtype=DTYPES[dtype], options=options)
    assert torch.equal(got.d_weight, clean.d_weight)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no-entropy"])
def test_nan_hidden_in_an_ignored_row_on_cuda_defaults(entropy: bool) -> None:
    case = make_case(300, 64, 1000, ignore_every=3)
    hidden, ignored = _with_nan_rows(case, math.nan)
    options = TorchOptions(block_vocab=256, chunk_rows=128)
    got = run_backend(case, device="cuda", options=options, hidden=hidden, return_entropy=entropy)
    assert not got.d_hidden[ignored].any() and torch.isfinite(got.d_hidden).all()
    clean = run_backend(case, device="cuda", options=options, return_entropy=entropy)
    assert torch.equal(got.d_weight, clean.d_weight)


# --- a recomputed logit that rounds above the forward's row max ----------------------------------

#: A case where a backward block (16 columns) rounds row 11's largest logit above what the
#: forward's 50-column tile gave: ``d = k (x' - x) > 0``, ``exp(d)`` inf at tiny temperatures.
RECOMPUTE_CASE = (30, 16, 50)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("temperature", [1e-25, 1e-10])
def test_a_recomputed_logit_above_the_forward_max_keeps_gradients_finite(
    compiled: bool, temperature: float
) -> None:
    case = make_case(*RECOMPUTE_CASE, ignore_every=3)
    options = TorchOptions(chunk_rows=10, block_vocab=16, compile_elementwise=compiled)
    got = run_backend(case, options=options, temperature=temperature)
    want = run_reference(case, temperature=temperature)
    _assert_extreme_close(got, want, "fp32", f"T={temperature:g} compiled={compiled}")


@pytest.mark.parametrize("temperature", [1e-25, 1e-10])
def test_a_recomputed_logit_above_the_forward_max_in_the_extra_outputs_backward(
    temperature: float,
) -> None:
    """The same class in the extra outputs' backward (``sum_p2`` takes that walk)."""
    case = make_case(*RECOMPUTE_CASE, ignore_every=3)
    h = case.hidden.float().requires_grad_()
    w = case.weight.float().requires_grad_()
    out = fusedhead.fused_head(
        h, w, case.labels, backend="torch", temperature=temperature, ignore_index=IGNORE,
        return_entropy=True, return_sum_p2=True, options={"chunk_rows": 10, "block_vocab": 16},
    )  # fmt: skip
    (out.log_probs.sum() + out.entropy.sum() + out.sum_p2.sum()).backward()
    assert h.grad is not None and w.grad is not None
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    want = run_reference(case, temperature=temperature)
    assert rel_err(out.log_probs.detach(), want.log_probs) <= 1e-5


# --- the backward's dz through torch.compile (compile_elementwise, the CUDA default) -------------


def _paths(**options: Any) -> tuple[TorchOptions, TorchOptions]:
    base = {"chunk_rows": 10, "block_vocab": 16, "skip_ignored_rows": False, **options}
    return TorchOptions(compile_elementwise=True, **base), TorchOptions(
        compile_elementwise=False, **base
    )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("feature", ["plain", "per-token-T", "no-entropy", "one-tile"])
def test_the_compiled_backward_keeps_the_forward_bits_and_the_gradients(
    dtype: str, feature: str
) -> None:
    """Only the backward's pointwise dz is compiled: the forward's statistics stay eager (the
    same bits, so batch and degree invariance hold), the gradients within the dtype's bounds."""
    case = make_case(30, 16, 50, ignore_every=4)
    kwargs: dict[str, Any] = {}
    if feature == "per-token-T":
        kwargs["temperature"] = torch.linspace(0.3, 3.0, 30)
    if feature == "no-entropy":
        kwargs["return_entropy"] = False
    extra = {"chunk_rows": None, "block_vocab": None} if feature == "one-tile" else {}
    fused, eager = _paths(**extra)
    got = run_backend(case, dtype=DTYPES[dtype], options=fused, **kwargs)
    plain = run_backend(case, dtype=DTYPES[dtype], options=eager, **kwargs)
    assert torch.equal(got.log_probs, plain.log_probs)
    if plain.entropy is not None:
        assert got.entropy is not None and torch.equal(got.entropy, plain.entropy)
    assert_close(got, run_reference(case, dtype=DTYPES[dtype], **kwargs), dtype, feature)


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_compiled_backward_gives_ignored_rows_exact_zeros(value: float, dtype: str) -> None:
    case = make_case(30, 16, 50, ignore_every=3)
    hidden, ignored = _with_nan_rows(case, value)
    fused, _ = _paths()
    got = run_backend(case, dtype=DTYPES[dtype], options=fused, hidden=hidden)
    assert not got.d_hidden[ignored].any() and torch.isfinite(got.d_hidden).all()
    assert torch.isfinite(got.d_weight).all()
    clean = run_backend(case, dtype=DTYPES[dtype], options=fused)
    assert torch.equal(got.d_weight, clean.d_weight)


def test_a_softcap_keeps_the_eager_backward() -> None:
    """The compiled pass has no softcap: with one the option changes nothing, bit for bit."""
    case = make_case(30, 16, 50, ignore_every=4)
    fused, eager = _paths()
    got = run_backend(case, options=fused, softcap=2.5)
    plain = run_backend(case, options=eager, softcap=2.5)
    assert torch.equal(got.d_hidden, plain.d_hidden) and torch.equal(got.d_weight, plain.d_weight)


def test_more_compiled_variants_than_dynamos_recompile_limit_in_one_process() -> None:
    """Dtypes, logits precision and per-row temperatures each specialise the compiled pass; a
    process that meets more of them than Dynamo's recompile limit (8 per code object) is an error
    under ``fullgraph=True``: each variant compiles a code object of its own."""
    case = make_case(12, 8, 20, ignore_every=4)
    variants = 0
    for dtype in ("fp32", "bf16", "fp16"):
        for fp32_logits in (True, False):
            if dtype == "fp32" and not fp32_logits:
                continue
            for temperature in (0.7, torch.linspace(0.5, 1.5, 12)):
                options = TorchOptions(
                    compile_elementwise=True, fp32_logits=fp32_logits, block_vocab=8
                )
                got = run_backend(
                    case, dtype=DTYPES[dtype], options=options, temperature=temperature
                )
                assert torch.isfinite(got.d_hidden).all() and torch.isfinite(got.d_weight).all()
                variants += 1
    assert variants == 10
