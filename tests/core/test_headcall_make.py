"""``HeadCall.make``, the call a backend's own unit tests build: its extras are output names it
knows, so a misspelt one is refused there, not silently asked of the backend."""

from __future__ import annotations

import pytest
import torch

from fusedhead.protocol import HeadCall


def _make(extras: object) -> HeadCall:
    return HeadCall.make(
        torch.zeros(2, 4), torch.zeros(8, 4), torch.zeros(2, dtype=torch.long), extras=extras
    )  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "extras", [{"arg_max"}, {"lse", "topk"}, "lse"], ids=["misspelt", "topk", "a-str"]
)
def test_an_unknown_extra_is_refused_with_the_known_ones(extras: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"extras must be a set of output names among \['lse', 'sum_p2', 'argmax'\]",
    ):
        _make(extras)


def test_known_extras_are_requested() -> None:
    assert _make(frozenset({"lse", "argmax"})).outputs == {"log_probs", "entropy", "lse", "argmax"}
