"""The triton KL of two heads with each head's softcap (``c * tanh(z / c)`` before its
temperature) against float64 full logits: values and the student's gradients (through the
student's tanh derivative), under the interpreter."""

from __future__ import annotations

import pytest
import torch
from test_triton_kl import DIRECTIONS, DTYPES, TINY, Heads, _assert_close, _kl, _reference


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(
    ("softcap", "teacher_softcap"),
    [(3.0, 2.0), (2.5, None), (None, 1.5)],
    ids=["both", "student", "teacher"],
)
def test_softcap_of_either_head_matches_float64(
    dtype: torch.dtype, direction: str, softcap: float | None, teacher_softcap: float | None
) -> None:
    """Caps of a few units against logits of several: the tanh bends every tile."""
    heads = Heads(29, 40, 24, 333, seed=21)
    got = _kl(heads, dtype, direction, softcap=softcap, teacher_softcap=teacher_softcap)
    want = _reference(heads, dtype, direction, softcap=softcap, teacher_softcap=teacher_softcap)
    _assert_close(got, want, dtype)
    plain = _reference(heads, dtype, direction)
    assert not torch.allclose(want[0], plain[0], rtol=1e-2)  # the caps do change the KL


def test_softcap_on_both_loaders_and_per_token_temperatures() -> None:
    heads = Heads(18, 32, 48, 500, seed=22)
    t_s = torch.linspace(0.5, 1.8, 18)
    for tma in (False, True):
        got = _kl(heads, torch.float16, "reverse", options={**TINY, "tma": tma}, temperature=t_s,
                  softcap=4.0, teacher_softcap=3.0)  # fmt: skip
        want = _reference(heads, torch.float16, "reverse", t_s, 1.3, 4.0, 3.0)
        _assert_close(got, want, torch.float16)
