"""The KL's labels of any integer dtype are compared with ``ignore_index`` as int64 values.

``fused_kl`` compared ``labels != ignore_index`` in the labels' own dtype, where torch wraps the
scalar into that dtype: uint8 label 156 equals -100 (mod 256), int16 label 1 equals
ignore_index=65537, so scored rows read as ignored and gave a KL of 0 and no gradient, silently.
``fused_head`` casts its labels to int64 first; the KL now does too.
"""

from __future__ import annotations

import pytest
import torch

from fusedhead import FusedHead, fused_kl

BACKENDS = {"torch": None, "triton": {"block_m": 16, "block_n": 16, "block_k": 16}}
#: (labels dtype, a label value of that dtype, an ignore_index that wraps onto it)
WRAPS = [
    (torch.uint8, 156, -100),
    (torch.int8, 28, 284),
    (torch.int16, 1, 65537),
    (torch.int32, 5, 2**32 + 5),
]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize(("dtype", "label", "ignore_index"), WRAPS, ids=lambda x: str(x))
def test_a_label_that_wraps_onto_ignore_index_is_still_scored(backend, dtype, label, ignore_index):
    g = torch.Generator().manual_seed(0)
    n, h, v = 6, 8, 300
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g) / 3
    t_hidden, t_weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / 3
    labels = torch.full((n,), label, dtype=dtype)
    opts = BACKENDS[backend]
    kl = fused_kl(hidden, weight, t_hidden, t_weight, labels, backend=backend, options=opts,
                  ignore_index=ignore_index)  # fmt: skip
    every = fused_kl(hidden, weight, t_hidden, t_weight, backend=backend, options=opts)
    assert torch.equal(kl, every)  # no row is ignored: the KL of labels=None
    assert bool((kl > 0).all())
    head = FusedHead({"backend": backend, "options": opts or {}, "ignore_index": ignore_index})
    assert torch.equal(head.kl(hidden, weight, t_hidden, t_weight, labels), every)
    kl.sum().backward()
    assert bool((hidden.grad.abs().sum(-1) > 0).all())


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.uint16])
def test_narrow_labels_equal_to_ignore_index_are_ignored(dtype):
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(4, 8, generator=g), torch.randn(50, 8, generator=g)
    t_hidden, t_weight = torch.randn(4, 8, generator=g), torch.randn(50, 8, generator=g)
    labels = torch.tensor([3, 7, 3, 9], dtype=dtype)
    kl = fused_kl(hidden, weight, t_hidden, t_weight, labels, ignore_index=3)
    assert kl[0] == 0 and kl[2] == 0 and bool((kl[[1, 3]] > 0).all())


def test_uint64_ids_are_refused_by_name_everywhere():
    """uint64 has no exact int64 form (2**64 - 100 would wrap onto ignore_index -100): labels of
    the head and of the KL, and gather_ids, are refused alike, naming the argument and dtype."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(4, 8, generator=g), torch.randn(30, 8, generator=g)
    y = torch.randint(0, 30, (4,), generator=g)
    calls = {
        "labels": lambda: FusedHead(backend="torch")(h, w, y.to(torch.uint64)),
        "labels ": lambda: fused_kl(h, w, h, w, y.to(torch.uint64), backend="torch"),
        "gather_ids": lambda: FusedHead(backend="torch")(
            h, w, y, gather_ids=y[:, None].to(torch.uint64)
        ),
    }
    for arg, call in calls.items():
        with pytest.raises(TypeError) as info:
            call()
        text = str(info.value)
        assert text.startswith(f"{arg.strip()} must be an integer tensor that converts to int64")
        assert "torch.uint64" in text, text


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("bad", [-1, 300, 2**40])
def test_a_label_out_of_range_is_refused_as_fused_head_refuses_it(backend, bad):
    """The KL reads labels as a mask only, so padding of -1 beside ignore_index=-100 was scored,
    silently. Now one read checks the range (with the temperatures), naming value and position;
    check_labels=False still scores such a row, as documented."""
    g = torch.Generator().manual_seed(2)
    n, h, v = 5, 8, 300
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    t_hidden, t_weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    labels = torch.tensor([4, -100, bad, 7, bad])
    opts = BACKENDS[backend]
    with pytest.raises(
        ValueError, match=rf"labels must be in \[0, 300\) .* got {bad} at flat position 2 \(2 label"
    ):
        fused_kl(hidden, weight, t_hidden, t_weight, labels, backend=backend, options=opts)
    with pytest.raises(ValueError, match="labels must be in"):
        FusedHead(backend=backend, options=opts or {}).kl(
            hidden, weight, t_hidden, t_weight, labels
        )
    kl = fused_kl(hidden, weight, t_hidden, t_weight, labels, backend=backend, options=opts,
                  check_labels=False)  # fmt: skip
    assert kl[1] == 0 and bool((kl[[0, 2, 3, 4]] > 0).all())


def test_a_compiled_kl_refuses_a_label_out_of_range_too():
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(4, 8, generator=g), torch.randn(30, 8, generator=g)

    @torch.compile(backend="eager", fullgraph=True)
    def kl(labels: torch.Tensor) -> torch.Tensor:
        return fused_kl(hidden, weight, hidden, weight * 2, labels, backend="torch")

    assert kl(torch.tensor([1, 2, -100, 3])).shape == (4,)
    with pytest.raises(ValueError, match="got -1 at flat position 3"):
        kl(torch.tensor([1, 2, -100, -1]))
