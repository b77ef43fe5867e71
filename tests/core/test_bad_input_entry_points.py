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
    with pytest.raises(TypeError, match=r"hidden must be a torch\.Tensor, got ndarray"):
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
