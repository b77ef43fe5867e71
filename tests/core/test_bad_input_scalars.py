"""The float scalars of a call (temperature, softcap, the KL's teacher ones, per-token
temperatures, the config's defaults): a value a kernel cannot use in fp32 is refused by name.

Every backend takes ``1 / temperature`` and ``z / softcap``; outside [2**-126, 2**126] one of
them overflows or flushes to zero in fp32, which gave NaN rows, wrong values or a RuntimeError
from deep inside torch before the core refused it (protocol.SCALAR_RANGE).
"""

from __future__ import annotations

import math

import pytest
import torch

from fusedhead import FusedHeadConfig, fused_head, fused_kl
from fusedhead.protocol import SCALAR_RANGE

#: Floats a kernel cannot take (each was accepted before, except the non-positive ones).
OUT_OF_RANGE = [1e-45, 5e-324, 1e-39, 1e300, 2.0**127, 0.0, -1.0, math.nan, math.inf]
#: The ends of the range, which run.
EDGES = [SCALAR_RANGE[0], 1e-30, 1e30, SCALAR_RANGE[1]]


def head(h, w, y, **kw):
    return fused_head(h, w, y, backend="ref-test", **kw)


def kl(h, w, y, **kw):
    return fused_kl(h, w, h, w, y, backend="ref-test", **kw)


@pytest.mark.parametrize("value", OUT_OF_RANGE)
@pytest.mark.parametrize("arg", ["temperature", "softcap"])
def test_head_scalars_out_of_range_name_the_argument_value_and_range(
    ref_backend, inputs, arg, value
):
    ref_backend.caps = {"softcap": True}
    with pytest.raises(ValueError) as info:
        head(*inputs(), **{arg: value})
    text = str(info.value)
    assert text.startswith(f"{arg} must be a finite float > 0 in [2**-126, 2**126]"), text
    assert f"got {value}" in text
    assert not ref_backend.calls, "the backend must not see the call"


@pytest.mark.parametrize("value", [1e-45, 1e300, 0.0])
@pytest.mark.parametrize(
    "arg", ["temperature", "teacher_temperature", "softcap", "teacher_softcap"]
)
def test_kl_scalars_out_of_range_are_named(ref_backend, inputs, arg, value):
    with pytest.raises(ValueError) as info:
        kl(*inputs(), **{arg: value})
    assert str(info.value).startswith(f"{arg} must be a finite float > 0 in [2**-126"), info.value
    assert f"got {value}" in str(info.value)


@pytest.mark.parametrize("value", EDGES)
def test_the_ends_of_the_range_run(ref_backend, inputs, value):
    ref_backend.caps = {"softcap": True, "per_token_temperature": True}
    h, w, y = inputs()
    lp, ent = head(h, w, y, temperature=value, softcap=value)
    assert lp.shape == y.shape and ent.shape == y.shape
    head(h, w, y, temperature=torch.full((6,), value))


@pytest.mark.parametrize("value", [1e-45, 1e-39, 0.0, -2.0, math.nan, math.inf])
def test_per_token_temperatures_out_of_range_name_the_first_value_and_position(
    ref_backend, inputs, value
):
    ref_backend.caps = {"per_token_temperature": True}
    h, w, y = inputs()
    t = torch.full((6,), 0.7)
    t[4] = value
    with pytest.raises(ValueError) as info:
        head(h, w, y, temperature=t)
    text = str(info.value)
    assert text.startswith("temperature tensor must hold finite values > 0 in [2**-126"), text
    assert "at flat position 4 (1 value(s) out of range)" in text
    shown = float(torch.tensor(value, dtype=torch.float32))  # the value as the kernels see it
    assert f"got {shown} (as fp32)" in text
    assert not ref_backend.calls


def test_a_float64_temperature_that_fp32_flushes_to_zero_is_refused(ref_backend, inputs):
    ref_backend.caps = {"per_token_temperature": True}
    h, w, y = inputs()
    with pytest.raises(ValueError, match=r"got 0\.0 \(as fp32\) at flat position 0"):
        head(h, w, y, temperature=torch.full((6,), 1e-300, dtype=torch.float64))


def test_teacher_temperature_tensor_is_named_as_such(ref_backend, inputs, monkeypatch):
    # the values are read with the call's other checks, after the capability gate (as a head
    # call's are): a backend that computes the KL with per-token temperatures (never reached)
    ref_backend.caps = {"kl_directions": ("forward",), "per_token_temperature": True}
    monkeypatch.setattr(ref_backend, "kl", lambda self, call: None, raising=False)
    h, w, y = inputs()
    t = torch.full((6,), 0.5)
    t[2] = 0.0
    with pytest.raises(ValueError) as info:
        kl(h, w, y, teacher_temperature=t)
    assert str(info.value).startswith("teacher_temperature tensor must hold finite values > 0")
    assert "at flat position 2" in str(info.value)


@pytest.mark.parametrize("arg", ["temperature", "teacher_temperature"])
def test_a_temperature_tensor_that_requires_grad_is_refused(ref_backend, inputs, arg):
    """fusedhead never differentiates a temperature: a tensor asking for its gradient would
    silently get none (the core detached it), so it is refused with the fix."""
    ref_backend.caps = {"per_token_temperature": True}
    h, w, y = inputs()
    t = torch.full((6,), 0.7, requires_grad=True)
    calls = [lambda: kl(h, w, y, **{arg: t})]
    if arg == "temperature":
        calls.append(lambda: head(h, w, y, temperature=t))
    for run in calls:
        with pytest.raises(ValueError) as info:
            run()
        text = str(info.value)
        assert text.startswith(f"{arg} tensor requires grad"), text
        assert f"pass {arg}.detach()" in text
    with torch.no_grad():  # no gradient is asked for: it runs
        head(h, w, y, temperature=t)
    head(h, w, y, temperature=t.detach())


@pytest.mark.parametrize("field", ["temperature", "softcap"])
@pytest.mark.parametrize("value", [1e-45, 1e300])
def test_the_config_refuses_what_a_call_would(field, value):
    with pytest.raises(ValueError) as info:
        FusedHeadConfig(**{field: value})
    text = str(info.value)
    assert f"field {field!r} = {value!r} (float)" in text and "[2**-126, 2**126]" in text
    FusedHeadConfig(**{field: SCALAR_RANGE[1]})  # the end of the range builds


def test_numpy_scalars_are_floats_and_numpy_bools_are_not(ref_backend, inputs):
    """A temperature or softcap from a NumPy-typed config runs as its float; a bool never does."""
    np = pytest.importorskip("numpy")
    ref_backend.caps = {"softcap": True}
    h, w, y = inputs()
    want = head(h, w, y, temperature=0.75, softcap=30.0)
    got = head(h, w, y, temperature=np.float32(0.75), softcap=np.int64(30))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for bad in (np.bool_(True), True):
        with pytest.raises(
            TypeError, match=r"temperature must be a float or a tensor \(per token\), got"
        ):
            head(h, w, y, temperature=bad)
    with pytest.raises(ValueError, match=r"got 0\.0"):
        head(h, w, y, temperature=np.float32(0.0))


@pytest.mark.parametrize("shape", [(4,), (1, 4, 1)])
def test_a_temperature_tensor_with_other_dimensions_than_the_labels_is_refused(ref_backend, shape):
    """``[B]`` beside ``[B, S]`` labels would broadcast along S (one value per position, not per
    sequence) and was taken silently when B == S: refused, naming ``[B, 1]``."""
    ref_backend.caps = {"per_token_temperature": True}
    h, w = torch.randn(4, 4, 8), torch.randn(10, 8)
    y = torch.randint(0, 10, (4, 4))
    with pytest.raises(ValueError, match=r"labels' number of dimensions .*\[B, 1\]"):
        head(h, w, y, temperature=torch.full(shape, 0.7))
    assert not ref_backend.calls
    head(h, w, y, temperature=torch.full((4, 1), 0.7))  # one per sequence
    head(h, w, y, temperature=torch.full((1,), 0.7))  # one element
    assert len(ref_backend.calls) == 2
