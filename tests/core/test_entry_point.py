"""``fused_head`` runs its own body without the ``locals()`` dict (``request.entry_point``): the
same signature, and the very request the body builds, for any arguments."""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import pytest
import torch

import fusedhead
from fusedhead.head import FusedHead
from fusedhead.request import HeadRequest, entry_point

#: A value for every keyword of fused_head that no default has (the request carries it as given).
GIVEN: dict[str, Any] = {
    "temperature": 0.5,
    "ignore_index": -7,
    "return_entropy": False,
    "process_group": "group",
    "vocab_start": 3,
    "vocab_size": 11,
    "reduce_hidden_grad": False,
    "check_labels": False,
    "softcap": 2.0,
    "top_k": 2,
    "gather_ids": "ids",
    "return_lse": True,
    "return_sum_p2": True,
    "return_argmax": True,
}


def test_the_signature_is_the_decorated_functions() -> None:
    """The generated function takes the decorated one's parameters, and a catch-all of unknown
    keywords that it refuses with a did-you-mean (``keywords.refuse``)."""
    generated = inspect.signature(fusedhead.fused_head, follow_wrapped=False)
    *params, unknown = generated.parameters.values()
    assert unknown.kind is inspect.Parameter.VAR_KEYWORD
    wrapped = inspect.signature(fusedhead.fused_head.__wrapped__)  # type: ignore[attr-defined]
    assert generated.replace(parameters=params) == wrapped
    assert inspect.signature(fusedhead.fused_head) == wrapped
    assert fusedhead.fused_head.__doc__ == fusedhead.fused_head.__wrapped__.__doc__  # type: ignore[attr-defined]


@pytest.mark.parametrize("given", [{}, GIVEN], ids=["defaults", "every-keyword"])
def test_the_request_is_the_one_the_body_builds(
    monkeypatch: pytest.MonkeyPatch, given: dict[str, Any]
) -> None:
    seen: list[HeadRequest] = []
    monkeypatch.setattr(FusedHead, "run", lambda self, req: seen.append(req))
    h, w, y = torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long)
    fusedhead.fused_head(h, w, y, **given)
    fusedhead.fused_head.__wrapped__(h, w, y, **given)  # type: ignore[attr-defined]
    fast, body = seen
    assert fast == body and type(fast) is HeadRequest
    assert fast.hidden is h and fast.weight is w and fast.labels is y
    for name, value in given.items():
        assert getattr(fast, name) == value, name


class Pair(NamedTuple):
    a: Any
    b: Any = 1


def _run(req: Pair, backend: str) -> tuple[Pair, str]:
    return req, backend


def test_a_function_without_every_field_is_refused() -> None:
    def lacks_b(a: Any, *, backend: str = "x") -> Any:
        return None

    with pytest.raises(TypeError, match=r"lacks Pair fields \['b'\]"):
        entry_point(Pair, _run)(lacks_b)


def test_varargs_are_refused() -> None:
    def star(a: Any, *rest: Any, b: Any = 1, backend: str = "x") -> Any:
        return None

    with pytest.raises(TypeError, match="only plain and keyword-only parameters"):
        entry_point(Pair, _run)(star)


def test_a_toy_entry_point_passes_fields_in_order_and_the_rest_by_name() -> None:
    @entry_point(Pair, _run)
    def call(a: Any, *, backend: str = "x", b: Any = 2) -> Any:
        raise AssertionError("the generated function runs instead")

    assert call(5) == (Pair(5, 2), "x")
    assert call(5, b=7, backend="y") == (Pair(5, 7), "y")
