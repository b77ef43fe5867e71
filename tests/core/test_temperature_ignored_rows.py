"""A per-token temperature is checked on scored rows only, as every other per-token input is:
a padding row (label ``ignore_index``) may hold 0 or NaN there, and the call runs as if it held
1.0, its own outputs 0 and its gradient exactly zero.

Before: ``fused_head`` and ``fused_kl`` refused a 0 on an ignored row ("must hold finite values
> 0 ... at flat position 0"), while the policy loss's per-token inputs and the reference took
anything there.
"""

from __future__ import annotations

import pytest
import torch

from fusedhead import fused_head, fused_kl
from fusedhead.errors import CapabilityError

BACKENDS = ["torch", "triton"]
N, H, V = 6, 16, 40


def _batch():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / 4
    labels = torch.randint(0, V, (N,), generator=g)
    labels[[1, 4]] = -100
    temperature = torch.rand(N, generator=g) + 0.5
    return hidden, weight, labels, temperature


@pytest.mark.parametrize("bad", [0.0, float("nan"), -1.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_ignored_rows_temperature_may_hold_anything(backend, bad):
    hidden, weight, labels, temperature = _batch()
    padded = temperature.clone()
    padded[[1, 4]] = bad
    results = []
    for t in (temperature, padded):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        out = fused_head(h, w, labels, temperature=t, backend=backend)
        (out.log_probs.sum() + out.entropy.sum()).backward()
        results.append((out.log_probs, out.entropy, h.grad, w.grad))
    for clean, padded_out in zip(*results, strict=True):
        torch.testing.assert_close(padded_out, clean, rtol=0, atol=0)
    assert bool((results[1][2][[1, 4]] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_scored_rows_bad_temperature_is_still_refused(backend):
    hidden, weight, labels, temperature = _batch()
    temperature[2] = 0.0
    with pytest.raises(
        ValueError, match=r"^temperature tensor must hold finite values > 0 .* at flat position 2 "
    ):
        fused_head(hidden, weight, labels, temperature=temperature, backend=backend)


@pytest.mark.parametrize("arg", ["temperature", "teacher_temperature"])
def test_the_kl_takes_anything_on_ignored_rows_too(arg):
    hidden, weight, labels, temperature = _batch()
    g = torch.Generator().manual_seed(1)
    teacher_hidden, teacher_weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    padded = temperature.clone()
    padded[[1, 4]] = float("nan")
    clean = fused_kl(
        hidden, weight, teacher_hidden, teacher_weight, labels=labels, **{arg: temperature}
    )
    got = fused_kl(hidden, weight, teacher_hidden, teacher_weight, labels=labels, **{arg: padded})
    torch.testing.assert_close(got, clean, rtol=0, atol=0)
    padded[2] = float("nan")
    with pytest.raises(
        ValueError, match=rf"^{arg} tensor must hold finite values > 0 .* at flat position 2 "
    ):
        fused_kl(hidden, weight, teacher_hidden, teacher_weight, labels=labels, **{arg: padded})


@pytest.mark.parametrize("ignored", [1e-4, 0.0, float("nan")])
def test_a_backends_min_temperature_is_checked_on_scored_rows_only(ignored):
    """triton declares min_temperature 1e-3: an ignored row's 1e-4 (or the 1.0 a padding 0 is
    replaced by, below a larger floor) was refused as the caller's value; a scored row's is."""
    hidden, weight, labels, temperature = _batch()
    padded = temperature.clone()
    padded[[1, 4]] = ignored
    clean = fused_head(hidden, weight, labels, temperature=temperature, backend="triton")
    got = fused_head(hidden, weight, labels, temperature=padded, backend="triton")
    torch.testing.assert_close(got.log_probs, clean.log_probs, rtol=0, atol=0)
    padded[3] = 1e-4
    with pytest.raises(
        CapabilityError, match=r"per-token temperature of 0.0001 .* at flat position 3 \(1 value"
    ):
        fused_head(hidden, weight, labels, temperature=padded, backend="triton")


def test_a_backend_gets_no_temperature_below_its_floor_on_ignored_rows(variant):
    """A backend declaring min_temperature 2.0 gets its floor on ignored rows (not the 1.0 a
    padding 0 is replaced by, nor the caller's 0.5), and its scored rows' values as given."""
    cls = variant("floored-2", caps={"min_temperature": 2.0, "per_token_temperature": True})
    hidden, weight, labels, _ = _batch()
    t = torch.tensor([3.0, 0.0, 2.5, 4.0, 0.5, 2.0])
    fused_head(hidden, weight, labels, temperature=t, backend="floored-2")
    assert cls.calls[-1]["temperature"].tolist() == [3.0, 2.0, 2.5, 4.0, 2.0, 2.0]
    t[2] = 1.5
    with pytest.raises(CapabilityError, match=r"of 1.5 \(as fp32\) at flat position 2 \(1 value"):
        fused_head(hidden, weight, labels, temperature=t, backend="floored-2")
