"""The exported entry points beside ``fused_head``/``fused_kl``: ``FusedLMHead`` (with and
without a bias) and the float64 yardstick ``reference_fused_head`` name a bad argument as the
call does, instead of failing inside torch (``torch.cat``, a matmul) on it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusedhead import FusedLMHead, reference_fused_head


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(
    ("hidden", "error", "words"),
    [
        ([[1.0] * 8], TypeError, ["hidden must be a torch.Tensor", "list"]),
        (torch.tensor(1.0), ValueError, ["hidden", "0-d"]),
    ],
)
def test_fused_lm_head_names_hidden_before_folding_its_bias(bias, hidden, error, words):
    """Before: with a bias, an AttributeError ('list' has no 'new_ones') or torch.cat's
    RuntimeError, from folding the bias into hidden before it was validated."""
    lm = FusedLMHead.from_linear(nn.Linear(8, 11, bias=bias))
    with pytest.raises(error) as info:
        lm(hidden, torch.zeros(1, dtype=torch.long))
    for word in words:
        assert word in str(info.value)


def test_fused_lm_head_without_labels_names_hidden():
    lm = FusedLMHead.from_linear(nn.Linear(8, 11, bias=True))
    with pytest.raises(TypeError, match=r"hidden must be a torch\.Tensor, got numpy\.ndarray"):
        lm(torch.randn(2, 8).numpy())


@pytest.mark.parametrize(
    ("mutate", "error", "words"),
    [
        (lambda h, w, y: (h.tolist(), w, y), TypeError, ["hidden must be a torch.Tensor"]),
        (lambda h, w, y: (h, w[:, :-1], y), ValueError, ["hidden must have shape [..., H]", "H=7"]),
        (lambda h, w, y: (h, w[0], y), ValueError, ["weight must have shape [V, H]"]),
        (lambda h, w, y: (h, w, y[:-1]), ValueError, ["labels must have hidden's leading shape"]),
        (lambda h, w, y: (h, w, y.float()), TypeError, ["labels must be an integer tensor"]),
    ],
)
def test_reference_names_its_arguments(inputs, mutate, error, words):
    """The exported float64 yardstick: before, AttributeError and matmul's RuntimeError."""
    with pytest.raises(error) as info:
        reference_fused_head(*mutate(*inputs()))
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(("arg", "value"), [("temperature", 0.0), ("softcap", -1.0)])
def test_reference_refuses_a_scalar_a_call_refuses(inputs, arg, value):
    with pytest.raises(ValueError, match=f"^{arg} must be a finite float > 0"):
        reference_fused_head(*inputs(), **{arg: value})


@pytest.mark.parametrize(
    ("kw", "error", "words"),
    [
        ({"ignore_index": None}, TypeError, "ignore_index must be an int, got NoneType None"),
        ({"ignore_index": 1.5}, TypeError, "ignore_index must be an int, got float 1.5"),
        ({"ignore_index": True}, TypeError, "ignore_index must be an int, got bool True"),
        ({"ignore_index": 2**70}, ValueError, "ignore_index must fit in int64"),
        ({"return_entropy": "no"}, TypeError, "return_entropy must be a bool, got str 'no'"),
        ({"return_entropy": 0}, TypeError, "return_entropy must be a bool, got int 0"),
        ({"compute_dtype": "float64"}, TypeError, "compute_dtype must be a floating torch.dtype"),
        ({"compute_dtype": torch.int64}, TypeError, "got dtype torch.int64"),
        ({"compute_dtype": torch.complex64}, TypeError, "got dtype torch.complex64"),
        (
            {"temperature": torch.ones(6, dtype=torch.long)},
            TypeError,
            "temperature tensor must be floating point, got dtype torch.int64",
        ),
        (
            {"temperature": torch.ones(6, dtype=torch.complex64)},
            TypeError,
            "temperature tensor must be floating point, got dtype torch.complex64",
        ),
        (
            {"temperature": torch.ones(6, device="meta")},
            ValueError,
            "temperature tensor must be on hidden's device cpu, got meta",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_reference_names_the_argument_a_call_would_name(inputs, kw, error, words):
    """Before: ignore_index=None raised torch.where's own TypeError, 2**70 an OverflowError, a
    return_entropy of "no" or 0 was taken for its truth, compute_dtype=torch.int64 truncated hidden
    to integers silently ("float64" raised 'Invalid device string'), an integer temperature
    tensor was used, a complex one lost its imaginary part with a warning, a meta one raised
    'Cannot copy out of meta tensor'."""
    with pytest.raises(error) as info:
        reference_fused_head(*inputs(), **kw)
    assert words in str(info.value), str(info.value)


def test_reference_refuses_hidden_that_is_not_floating_point(inputs):
    h, w, y = inputs()
    with pytest.raises(TypeError, match="hidden must be a floating-point tensor, got dtype"):
        reference_fused_head(h.to(torch.complex64), w, y)


#: Ignored rows and what they hold: NaN or inf in the hidden state, a temperature that is NaN,
#: inf, 0 or negative (an unchecked call may hand such values over; none of it may be read).
_POISON = {1: ("nan", float("nan")), 3: ("inf", float("inf")), 4: ("one-nan", 0.0), 5: (0.0, -1.0)}


def _poisoned(inputs, poison: bool):
    h, w, y = inputs(dtype=torch.float64)
    t = torch.rand(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.5
    for row, (hidden, temperature) in _POISON.items():
        y[row] = -100
        h[row] = 0.0
        t[row] = 1.0
        if poison:
            if hidden == "one-nan":
                h[row, 2] = float("nan")
            else:
                h[row] = float(hidden)
            t[row] = temperature
    return h.requires_grad_(), w.requires_grad_(), y, t


def test_reference_ignored_rows_give_zero_and_reach_no_gradient(inputs):
    """Before: an ignored row's NaN hidden state (or NaN temperature) reached every entry of
    weight.grad through the full-logits matmul's backward (0 * NaN), though the docstring says
    "Ignored rows give 0 and no gradient". Now those rows are selected out before the matmul."""

    def run(poison: bool):
        h, w, y, t = _poisoned(inputs, poison)
        lp, ent = reference_fused_head(h, w, y, temperature=t, softcap=3.0)
        assert ent is not None
        (lp.sum() + 2 * ent.sum()).backward()
        return lp, ent, h.grad, w.grad

    lp, ent, gh, gw = run(True)
    clean = run(False)
    bad = list(_POISON)
    assert bool((lp[bad] == 0).all()) and bool((ent[bad] == 0).all())
    assert bool((gh[bad] == 0).all()) and bool(torch.isfinite(gw).all())
    for got, want in zip((lp, ent, gh, gw), clean, strict=True):
        assert torch.equal(got, want)


def test_reference_policy_loss_ignored_rows_reach_no_gradient(inputs):
    """The policy loss's yardstick, through the head's: NaN in an ignored row's hidden state,
    temperature, old log-prob or advantage reaches neither the loss nor a gradient."""
    from fusedhead.reference import reference_policy_loss

    def run(poison: bool):
        h, w, y, t = _poisoned(inputs, poison)
        old = torch.full(y.shape, -1.0, dtype=torch.float64)
        adv = torch.linspace(-1.0, 1.0, y.numel(), dtype=torch.float64)
        if poison:
            old[1], adv[3] = float("nan"), float("inf")
        loss = reference_policy_loss(
            h, w, y, old_log_probs=old, advantages=adv, temperature=t, entropy_coef=0.01,
            ref_log_probs=old, kl_coef=0.1,
        )  # fmt: skip
        loss.backward()
        return loss, h.grad, w.grad

    loss, gh, gw = run(True)
    clean = run(False)
    assert bool((gh[list(_POISON)] == 0).all()) and bool(torch.isfinite(gw).all())
    for got, want in zip((loss, gh, gw), clean, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("kw", "error", "words"),
    [
        (
            {"clip_low": "x"},
            TypeError,
            "clip_low must be a float (a finite float >= 0), got str 'x'",
        ),
        ({"clip_low": float("nan")}, ValueError, "clip_low must be a finite float >= 0, got nan"),
        ({"clip_high": None}, TypeError, "clip_high must be a float"),
        ({"dual_clip": "3"}, TypeError, "dual_clip must be a float"),
        ({"dual_clip": 1.0}, ValueError, "dual_clip must be a finite float > 1"),
        ({"entropy_coef": None}, TypeError, "entropy_coef must be a float"),
        (
            {"entropy_coef": True},
            TypeError,
            "entropy_coef must be a float (a finite float), got bool",
        ),
        ({"kl_coef": "1"}, TypeError, "kl_coef must be a float (a finite float >= 0), got str"),
        ({"kl_coef": float("inf")}, ValueError, "kl_coef must be a finite float >= 0, got inf"),
        ({"loss_normalizer": "x"}, TypeError, "loss_normalizer must be a float"),
        ({"loss_normalizer": 0.0}, ValueError, "loss_normalizer must be a count > 0"),
        ({"ignore_index": None}, TypeError, "ignore_index must be an int, got NoneType None"),
        (
            {"advantages": torch.ones(6, dtype=torch.long)},
            TypeError,
            "advantages must be a floating tensor (fp32, fp64, fp16, bf16), got torch.int64",
        ),
        (
            {"old_log_probs": torch.zeros(6, device="meta")},
            ValueError,
            "old_log_probs must be on the labels' device cpu, got meta",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_reference_policy_loss_names_a_bad_number(inputs, kw, error, words):
    """Before: a str or None raised Python's "unsupported operand type(s)" (dual_clip "3" torch's
    "only integer tensors of a single element can be converted to an index"), NaN or inf gave a
    NaN loss, a bool entropy_coef was taken as 1, an integer advantages tensor was used, a meta
    one raised 'Cannot copy out of meta tensor'."""
    from fusedhead.reference import reference_policy_loss

    h, w, y = inputs()
    args = {"old_log_probs": torch.zeros(6), "advantages": torch.ones(6), **kw}
    with pytest.raises(error) as info:
        reference_policy_loss(h, w, y, **args)
    assert words in str(info.value), str(info.value)


@pytest.mark.parametrize("name", ["nope", "torch"])
def test_unregistering_an_unregistered_name_names_it(ref_backend, name):
    """Before: 'is not registered in-process', with no name in the message."""
    from fusedhead import registry
    from fusedhead.errors import UnknownBackendError

    with pytest.raises(UnknownBackendError) as info:
        registry.unregister_backend(name)
    text = str(info.value)
    assert f"backend {name!r} is not registered in-process" in text
    assert "registered in-process: ref-test" in text and info.value.backend == name


@pytest.mark.parametrize("name", [3, None, b"ref-test"])
def test_unregistering_a_name_that_is_no_str_is_a_type_error(ref_backend, name):
    """Before: an UnknownBackendError (a KeyError) saying nothing of the type."""
    from fusedhead import registry

    with pytest.raises(TypeError) as info:
        registry.unregister_backend(name)
    assert "backend must be a str" in str(info.value) and type(name).__name__ in str(info.value)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(
    ("hidden", "error", "words"),
    [
        (
            torch.randn(2, 9),
            ValueError,
            ["hidden's last dimension must equal weight's H=8", "(2, 9)"],
        ),
        (torch.tensor(1.0), ValueError, ["hidden's last dimension", "shape ()"]),
        (
            torch.randn(2, 8).double(),
            TypeError,
            ["hidden and weight must share a dtype", "float64"],
        ),
        (
            torch.ones(2, 8, dtype=torch.long),
            TypeError,
            ["hidden must be a floating-point", "int64"],
        ),
        (torch.randn(2, 8, device="meta"), ValueError, ["hidden must be on the weight's device"]),
    ],
)
def test_fused_lm_head_logits_path_names_a_mismatched_hidden(bias, hidden, error, words):
    """Without labels the head is the nn.Linear it replaced; a mismatch was torch's RuntimeError
    ('mat1 and mat2 shapes cannot be multiplied', 'expected m1 and m2 to have the same dtype')."""
    lm = FusedLMHead.from_linear(nn.Linear(8, 11, bias=bias))
    with pytest.raises(error) as info:
        lm(hidden)
    for word in words:
        assert word in str(info.value)


def test_fused_lm_head_logits_path_takes_what_nn_linear_takes():
    linear = nn.Linear(8, 11)
    lm = FusedLMHead.from_linear(linear)
    h = torch.randn(3, 8)
    assert torch.equal(lm(h), linear(h))
    assert torch.equal(lm(h.to_sparse()), linear(h.to_sparse()))  # a sparse hidden, as before
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed dtypes under autocast
        assert lm(h.bfloat16()).dtype == torch.bfloat16
