"""Every rule of the contract's validation: a clear error naming the argument, before any backend runs."""

from __future__ import annotations

import math

import pytest
import torch

from fusedhead import fused_head
from fusedhead.errors import BackendError, CapabilityError
from fusedhead.protocol import HeadOutput


def call(h, w, y, **kw):
    return fused_head(h, w, y, backend="ref-test", **kw)


@pytest.mark.parametrize(
    ("mutate", "exc", "words"),
    [
        (lambda h, w, y: ([1.0], w, y), TypeError, ["hidden", "torch.Tensor"]),
        (lambda h, w, y: (h, w.tolist(), y), TypeError, ["weight", "torch.Tensor"]),
        (lambda h, w, y: (h, w, y.tolist()), TypeError, ["labels", "torch.Tensor"]),
        (lambda h, w, y: (h, w[0], y), ValueError, ["weight", "[V, H]"]),
        (lambda h, w, y: (h[:, :-1], w, y), ValueError, ["hidden", "H=8"]),
        (lambda h, w, y: (h, w, y[:-1]), ValueError, ["labels", "shape"]),
        (lambda h, w, y: (h, w, y.float()), TypeError, ["labels", "integer"]),
        (lambda h, w, y: (h, w, y.bool()), TypeError, ["labels", "integer"]),
        (lambda h, w, y: (h.double(), w.double(), y), TypeError, ["hidden", "float64"]),
        (lambda h, w, y: (h.half(), w, y), TypeError, ["hidden", "weight", "dtype", "autocast"]),
        (lambda h, w, y: (h, w[:0], y), ValueError, ["weight", "non-empty"]),
        (lambda h, w, y: (h[:, :0], w[:, :0], y), ValueError, ["weight", "non-empty"]),
        (lambda h, w, y: (h, w.to("meta"), y), ValueError, ["hidden", "weight", "device"]),
        (lambda h, w, y: (h, w, y.to("meta")), ValueError, ["labels", "device"]),
        (lambda h, w, y: (torch.tensor(1.0), w, y), ValueError, ["hidden", "0-d"]),
    ],
)
def test_bad_tensors_name_the_argument(ref_backend, inputs, mutate, exc, words):
    h, w, y = mutate(*inputs())
    with pytest.raises(exc) as info:
        call(h, w, y)
    for word in words:
        assert word in str(info.value)
    assert not ref_backend.calls, "the backend must not see an invalid call"


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, math.inf])
def test_temperature_must_be_finite_and_positive(ref_backend, inputs, temperature):
    with pytest.raises(ValueError, match="temperature"):
        call(*inputs(), temperature=temperature)


@pytest.mark.parametrize("temperature", [True, "0.7", None])
def test_temperature_must_be_a_float(ref_backend, inputs, temperature):
    with pytest.raises(TypeError, match="temperature"):
        call(*inputs(), temperature=temperature)


def test_temperature_tensor_is_checked(ref_backend, inputs):
    ref_backend.caps = {"per_token_temperature": True}
    h, w, y = inputs()
    with pytest.raises(ValueError, match="temperature"):
        call(h, w, y, temperature=torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match=r"temperature.*broadcast"):
        call(h, w, y, temperature=torch.ones(5))
    with pytest.raises(TypeError, match="temperature"):
        call(h, w, y, temperature=torch.ones(6, dtype=torch.int64))


def test_per_token_temperature_needs_the_capability(ref_backend, inputs):
    with pytest.raises(CapabilityError, match="per_token_temperature"):
        call(*inputs(), temperature=torch.ones(6))


def test_softcap_needs_the_capability_and_a_positive_value(ref_backend, inputs):
    with pytest.raises(CapabilityError, match="softcap"):
        call(*inputs(), softcap=30.0)
    ref_backend.caps = {"softcap": True}
    with pytest.raises(ValueError, match="softcap"):
        call(*inputs(), softcap=0.0)


@pytest.mark.parametrize("arg", ["return_entropy", "check_labels", "reduce_hidden_grad"])
def test_flags_must_be_bool(ref_backend, inputs, arg):
    with pytest.raises(TypeError, match=arg):
        call(*inputs(), **{arg: 1})


def test_ignore_index_must_be_int(ref_backend, inputs):
    with pytest.raises(TypeError, match="ignore_index"):
        call(*inputs(), ignore_index=-100.0)


@pytest.mark.parametrize("bad", [11, 12, -1, -99])
def test_labels_out_of_range_are_refused_with_their_value(ref_backend, inputs, bad):
    h, w, y = inputs()
    y[3] = bad
    with pytest.raises(ValueError) as info:
        call(h, w, y)
    msg = str(info.value)
    assert "labels" in msg and str(bad) in msg and "[0, 11)" in msg and "position 3" in msg


def test_ignore_index_labels_are_accepted_and_zeroed(ref_backend, inputs):
    h, w, y = inputs()
    y[2] = -100
    out = call(h, w, y)
    assert out.log_probs[2] == 0 and out.entropy is not None and out.entropy[2] == 0


def test_check_labels_false_passes_labels_through(ref_backend, inputs):
    h, w, y = inputs()
    y[0] = 1000
    call(h, w, y, check_labels=False)
    assert int(ref_backend.calls[-1]["labels"][0]) == 1000


def test_vocab_range_arguments_need_a_process_group(ref_backend, inputs):
    with pytest.raises(ValueError, match="vocab_start"):
        call(*inputs(), vocab_start=5)
    with pytest.raises(ValueError, match="vocab_size"):
        call(*inputs(), vocab_size=100)


def test_process_group_needs_the_capability(ref_backend, inputs):
    with pytest.raises((CapabilityError, ValueError), match="process_group"):
        call(*inputs(), process_group=object())


def test_dtensor_is_refused_with_fsdp2_advice(ref_backend, inputs):
    class DTensor(torch.Tensor):
        pass

    h, w, y = inputs()
    dw = torch.Tensor._make_subclass(DTensor, w)
    with pytest.raises(TypeError) as info:
        call(h, dw, y)
    text = str(info.value)
    assert "weight" in text and "FSDP2" in text and "FusedLMHead" in text
    # a sharded weight's local tensor is part of the vocabulary: never advised for the weight
    assert "not weight.to_local()" in text, text
    dh = torch.Tensor._make_subclass(DTensor, h)
    with pytest.raises(TypeError, match=r"pass hidden\.to_local\(\)"):
        call(dh, w, y)


def test_zero_rows_give_empty_outputs_and_zero_grads(ref_backend, inputs):
    h, w, _ = inputs()
    h = h[:0].clone().requires_grad_()
    w = w.clone().requires_grad_()
    out = call(h, w, torch.zeros(0, dtype=torch.long))
    assert out.log_probs.shape == (0,) and out.log_probs.dtype == torch.float32
    assert out.entropy is not None and out.entropy.shape == (0,)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert h.grad is not None and h.grad.shape == h.shape
    assert w.grad is not None and torch.equal(w.grad, torch.zeros_like(w))
    assert not ref_backend.calls


def test_zero_rows_keep_leading_shape(ref_backend, inputs):
    h, w, _ = inputs()
    out = call(
        h.reshape(2, 3, 8)[:, :0], w, torch.zeros(2, 0, dtype=torch.long), return_entropy=False
    )
    assert out.log_probs.shape == (2, 0) and out.entropy is None


def test_backend_sees_two_d_contiguous_int64_labels(ref_backend, inputs):
    h, w, y = inputs(n=12)
    out = call(h.reshape(3, 4, 8), w, y.reshape(3, 4).int())
    seen = ref_backend.calls[-1]
    assert seen["hidden"].shape == (12, 8) and seen["labels"].dtype == torch.int64
    assert seen["vocab_start"] == 0 and seen["vocab_size"] == 11
    assert out.log_probs.shape == (3, 4) and out.entropy is not None and out.entropy.shape == (3, 4)


def test_autocast_computes_in_the_autocast_dtype(ref_backend, inputs):
    h, w, y = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        call(h, w.bfloat16(), y)
    seen = ref_backend.calls[-1]
    assert seen["hidden"].dtype == torch.bfloat16 and seen["weight"].dtype == torch.bfloat16


def test_a_backend_breaking_the_output_contract_is_caught(ref_backend, inputs, monkeypatch):
    def bad_forward(self, call):
        return HeadOutput(torch.zeros(call.labels.shape[0], dtype=torch.float64))

    monkeypatch.setattr(ref_backend, "forward", bad_forward)
    with pytest.raises(BackendError, match="log_probs must be float32"):
        call(*inputs())
