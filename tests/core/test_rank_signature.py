"""The vocab-parallel agreement's signature (``fusedhead.rank_agreement.signature``) tells apart
calls that differ by a change its checksums used to cancel: weights affine in the position left
any change whose differences sum to 0 at their mean position unseen (labels 5, 3, 7 rotated to
3, 7, 5 on one rank: its log-probs off by up to 6, no error)."""

from __future__ import annotations

import pytest
import torch

from fusedhead.protocol import HeadCall
from fusedhead.rank_agreement import FIELDS, signature

N, H, V = 12, 16, 37


def _sig(call: HeadCall) -> list[int]:
    return signature(call, call.hidden.dtype, False, None, "torch").tolist()


def _field(name: str) -> int:
    return [f for f, _ in FIELDS].index(name)


def _call(hidden: torch.Tensor, labels: torch.Tensor, **kw: object) -> HeadCall:
    return HeadCall.make(hidden, torch.zeros(V, H, dtype=hidden.dtype), labels, **kw)  # type: ignore[arg-type]


def _inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, H, generator=g).to(dtype), torch.randint(0, V, (N,), generator=g)


@pytest.mark.parametrize("start", [0, 4, 9])
def test_labels_rotated_over_three_rows_change_the_signature(start: int) -> None:
    hidden, labels = _inputs()
    labels[start : start + 3] = torch.tensor([5, 3, 7])
    other = labels.clone()
    other[start : start + 3] = torch.tensor([3, 7, 5])  # 2a - b - c == 0 at the middle row
    a, b = _sig(_call(hidden, labels)), _sig(_call(hidden, other))
    assert a[_field("labels")] != b[_field("labels")]
    assert [x for i, x in enumerate(a) if i != _field("labels")] == [
        x for i, x in enumerate(b) if i != _field("labels")
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("along", ["columns", "rows"])
def test_bit_changes_of_plus_one_minus_two_plus_one_change_the_signature(
    dtype: torch.dtype, along: str
) -> None:
    hidden, labels = _inputs(dtype)
    bits = hidden.view(torch.int32 if dtype == torch.float32 else torch.int16)
    step = 1 << 20 if dtype == torch.float32 else 1
    changed = hidden.clone()
    cbits = changed.view(bits.dtype)
    for k, d in enumerate((1, -2, 1)):
        at = (2, 3 + k) if along == "columns" else (3 + k, 2)
        cbits[at] += d * step
    a, b = _sig(_call(hidden, labels)), _sig(_call(changed, labels))
    assert a[_field("hidden")] != b[_field("hidden")]


def test_equal_calls_give_equal_signatures_and_minus_zero_is_zero() -> None:
    hidden, labels = _inputs()
    hidden[0, 0] = 0.0
    same = hidden.clone()
    same[0, 0] = -0.0
    assert _sig(_call(hidden, labels)) == _sig(_call(same, labels))
    assert _sig(_call(hidden, labels)) == _sig(_call(hidden.clone(), labels.clone()))


def test_per_token_temperatures_swapped_between_rows_change_the_signature() -> None:
    hidden, labels = _inputs()
    temp = torch.linspace(0.5, 1.5, N)
    other = temp.clone()
    other[[3, 4, 5]] = temp[[4, 5, 3]]
    a = _sig(_call(hidden, labels, temperature=temp))
    b = _sig(_call(hidden, labels, temperature=other))
    assert a[_field("temperature")] != b[_field("temperature")]
