"""Ignored rows (label ignore_index) whose hidden state is NaN or +-inf: nothing of theirs reaches
any output, dz, dh or dW, for every output of every first-party backend that runs here and each
dtype (triton under the interpreter: fp32 and fp16). A padding row after fully-masked attention
is exactly such a row.

Before: the triton backend's dz was ``p * 0`` on those rows (NaN) and its cuBLAS weight GEMM read
the rows' NaN hidden states (``0 * NaN``), so ``weight.grad`` was NaN for every output and the
KL; the liger adapter leaked the same way through Liger's GEMMs. Now the rows are selected out
(``where``), never multiplied by 0: the outputs there are exactly 0, the row's hidden gradient is
exactly 0, and every other gradient equals the one of the same call with those rows zeroed.
"""

from __future__ import annotations

import pytest
import torch

from fusedhead import fused_head, fused_kl

N, H, V = 7, 16, 40
IGNORE = -100
#: Ignored rows and what their hidden state holds.
BAD_ROWS = {1: "nan", 3: "inf", 4: "-inf", 5: "one-nan"}
OUTPUTS = {
    "log_probs": {},
    "entropy": {},
    "lse": {"return_lse": True},
    "sum_p2": {"return_sum_p2": True},
    "argmax": {"return_argmax": True},
    "topk": {"top_k": 3},
    "gather": {"gather_ids": (torch.arange(2 * N).reshape(N, 2) * 3) % V},
}
_TRITON_TILES = {"block_m": 16, "block_n": 16, "block_k": 16}
#: (backend, options, dtypes) by id.
CASES = {
    "torch-skip-rows": ("torch", {"skip_ignored_rows": True}, ("fp32", "fp16", "bf16")),
    "torch-all-rows": ("torch", {"skip_ignored_rows": False}, ("fp32", "fp16", "bf16")),
    "torch-tiled": (
        "torch",
        {"skip_ignored_rows": False, "block_vocab": 16, "chunk_rows": 3},
        ("fp32", "bf16"),
    ),
    "triton": ("triton", _TRITON_TILES, ("fp32", "fp16")),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PARAMS = [
    pytest.param(backend, options, dtype, id=f"{case}-{dtype}")
    for case, (backend, options, dtypes) in CASES.items()
    for dtype in dtypes
]


def _inputs(dtype: torch.dtype, poison: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / 4
    labels = torch.randint(0, V, (N,), generator=g)
    for row, what in BAD_ROWS.items():
        labels[row] = IGNORE
        if not poison:
            hidden[row] = 0.0
        elif what == "one-nan":
            hidden[row, 2] = float("nan")
        else:
            hidden[row] = float(what)
    return hidden.to(dtype), weight.to(dtype), labels


def _differentiable(out) -> list[torch.Tensor]:
    ts = [out.log_probs, out.entropy]
    ts += [getattr(out, f) for f in ("lse", "sum_p2", "topk_log_probs", "gathered")]
    return [t for t in ts if t is not None]


def _run(backend, options, dtype, kwargs, poison):
    hidden, weight, labels = _inputs(dtype, poison)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    out = fused_head(h, w, labels, backend=backend, options=options, **kwargs)
    ts = _differentiable(out)
    sum(((i + 1) * t.float()).sum() for i, t in enumerate(ts)).backward()
    return out, ts, h.grad, w.grad


def _assert_nothing_leaks(poisoned, clean) -> None:
    out, ts, gh, gw = poisoned
    _, clean_ts, clean_gh, clean_gw = clean
    bad = list(BAD_ROWS)
    for t, want in zip(ts, clean_ts, strict=True):
        assert bool((t[bad] == 0).all()), "an ignored row's output is not exactly 0"
        assert torch.equal(t, want), "an ignored row changed another row's output"
    for ids in (out.argmax, out.topk_ids):
        if ids is not None:
            assert bool((ids[bad] == -1).all())
    assert bool(torch.isfinite(gw).all()), "weight.grad is not finite"
    assert bool((gh[bad] == 0).all()), "an ignored row's hidden gradient is not exactly 0"
    assert torch.equal(gw, clean_gw) and torch.equal(gh, clean_gh)


@pytest.mark.parametrize("output", list(OUTPUTS))
@pytest.mark.parametrize(("backend", "options", "dtype"), PARAMS)
def test_nan_and_inf_in_ignored_rows_reach_nothing(backend, options, dtype, output):
    kwargs = OUTPUTS[output]
    poisoned = _run(backend, options, DTYPES[dtype], kwargs, poison=True)
    clean = _run(backend, options, DTYPES[dtype], kwargs, poison=False)
    _assert_nothing_leaks(poisoned, clean)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize(("backend", "options", "dtype"), PARAMS)
def test_nan_and_inf_in_ignored_rows_reach_nothing_in_the_kl(backend, options, dtype, direction):
    def run(poison: bool):
        hidden, weight, labels = _inputs(DTYPES[dtype], poison)
        t_hidden, t_weight, _ = _inputs(DTYPES[dtype], poison, seed=1)
        h, w = hidden.requires_grad_(), weight.requires_grad_()
        kl = fused_kl(
            h, w, t_hidden, t_weight, labels, direction=direction, backend=backend, options=options
        )
        kl.sum().backward()
        return kl, h.grad, w.grad

    kl, gh, gw = run(True)
    clean_kl, clean_gh, clean_gw = run(False)
    bad = list(BAD_ROWS)
    assert bool((kl[bad] == 0).all()) and torch.equal(kl, clean_kl)
    assert bool(torch.isfinite(gw).all()) and bool((gh[bad] == 0).all())
    assert torch.equal(gw, clean_gw) and torch.equal(gh, clean_gh)


@pytest.mark.parametrize("return_entropy", [True, False])
def test_the_liger_adapter_masks_ignored_rows_before_liger(return_entropy):
    """Liger's chunked path (``implementation: fallback``, the one that runs on the CPU); the
    native kernel gets the same masked hidden (scripts/gpu/ignored_rows_check.py on an H200)."""
    pytest.importorskip("liger_kernel")
    options = {"implementation": "fallback"}

    def run(poison: bool):
        hidden, weight, labels = _inputs(torch.float32, poison)
        labels[6] = V + 5  # out of range: NaN out, Liger sees it as ignored
        h, w = hidden.requires_grad_(), weight.requires_grad_()
        out = fused_head(
            h, w, labels, backend="liger", options=options, return_entropy=return_entropy,
            check_labels=False,
        )  # fmt: skip
        ts = [t for t in out if t is not None]
        sum(torch.nan_to_num(t).sum() for t in ts).backward()
        return ts, h.grad, w.grad

    ts, gh, gw = run(True)
    clean_ts, clean_gh, clean_gw = run(False)
    bad = list(BAD_ROWS)
    for t, want in zip(ts, clean_ts, strict=True):
        assert bool((t[bad] == 0).all()) and torch.equal(t[:6], want[:6])
        assert bool(t[6].isnan())
    assert bool(torch.isfinite(gw).all()) and bool((gh[bad] == 0).all())
    assert torch.equal(gw, clean_gw) and torch.equal(gh, clean_gh)


#: A per-token temperature that an unchecked call (``check_labels=False``) hands over on the
#: ignored rows: none of it is ever read.
BAD_TEMPERATURES = {1: float("nan"), 3: float("inf"), 4: 0.0, 5: -1.0}


def _temperature(poison: bool, seed: int = 0) -> torch.Tensor:
    t = torch.rand(N, generator=torch.Generator().manual_seed(seed + 7)) + 0.5
    for row, value in BAD_TEMPERATURES.items():
        t[row] = value if poison else 1.0
    return t


@pytest.mark.parametrize("output", list(OUTPUTS))
@pytest.mark.parametrize(("backend", "options", "dtype"), PARAMS)
def test_an_ignored_rows_temperature_reaches_nothing(backend, options, dtype, output):
    """Before: the torch backend without ``skip_ignored_rows`` (its CUDA default) scaled the
    recomputed tiles of an ignored row by ``1 / NaN``, so ``weight.grad`` was NaN everywhere
    and the row's hidden gradient NaN. Now an ignored row's temperature is never read."""

    def run(poison: bool):
        hidden, weight, labels = _inputs(DTYPES[dtype], poison=False)
        h, w = hidden.requires_grad_(), weight.requires_grad_()
        out = fused_head(
            h, w, labels, temperature=_temperature(poison), check_labels=False,
            backend=backend, options=options, **OUTPUTS[output],
        )  # fmt: skip
        ts = _differentiable(out)
        sum(((i + 1) * t.float()).sum() for i, t in enumerate(ts)).backward()
        return out, ts, h.grad, w.grad

    _assert_nothing_leaks(run(poison=True), run(poison=False))


@pytest.mark.parametrize("teacher", [False, True], ids=["student", "teacher"])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize(("backend", "options", "dtype"), PARAMS)
def test_an_ignored_rows_temperature_reaches_nothing_in_the_kl(
    backend, options, dtype, direction, teacher
):
    """The KL's student and teacher temperatures, as the head's (before: NaN gradients)."""

    def run(poison: bool):
        hidden, weight, labels = _inputs(DTYPES[dtype], poison=False)
        t_hidden, t_weight, _ = _inputs(DTYPES[dtype], poison=False, seed=1)
        h, w = hidden.requires_grad_(), weight.requires_grad_()
        temps = {
            "temperature": _temperature(poison and not teacher),
            "teacher_temperature": _temperature(poison and teacher, seed=1),
        }
        kl = fused_kl(
            h, w, t_hidden, t_weight, labels, direction=direction, check_labels=False,
            backend=backend, options=options, **temps,
        )  # fmt: skip
        kl.sum().backward()
        return kl, h.grad, w.grad

    kl, gh, gw = run(True)
    clean_kl, clean_gh, clean_gw = run(False)
    bad = list(BAD_TEMPERATURES)
    assert bool((kl[bad] == 0).all()) and torch.equal(kl, clean_kl)
    assert bool(torch.isfinite(gw).all()) and bool((gh[bad] == 0).all())
    assert torch.equal(gw, clean_gw) and torch.equal(gh, clean_gh)
