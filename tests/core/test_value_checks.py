"""A call's value checks (label and id ranges, per-token temperatures): one host read, before the
backend's ``forward``, the first failed check named; on the CPU and on CUDA alike."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fusedhead import FusedHead

DEVICES = ["cpu"]  # on CUDA the read comes after forward: test_pending_checks_gpu.py


def _case(device: str, n: int = 40, h: int = 32, v: int = 611) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5
    labels = torch.randint(0, v, (n,), generator=g)
    return tuple(t.to(device) for t in (hidden, weight, labels))


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``spied(device)``: the torch backend's head there, and the order of the host's reads of
    tensor values (with their sizes) and of the backend's forward calls."""

    def make(device: str) -> tuple[FusedHead, list[object]]:
        order: list[object] = []
        head = FusedHead(backend="torch", device=device)
        real_forward = head.backend.forward
        real_tolist = torch.Tensor.tolist

        def forward(call: Any) -> Any:
            order.append("forward")
            return real_forward(call)

        def tolist(t: torch.Tensor) -> Any:
            order.append(("read", t.numel()))
            return real_tolist(t)

        monkeypatch.setattr(head.backend, "forward", forward)
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        return head, order

    return make


@pytest.mark.parametrize("device", DEVICES)
def test_labels_ids_and_temperatures_are_one_read_before_the_forward(spied, device):
    head, order = spied(device)
    hidden, weight, labels = _case(device)
    ids = torch.zeros(40, 3, dtype=torch.long, device=device)
    temperature = torch.full((40,), 0.7, device=device)
    out = head(hidden, weight, labels, temperature=temperature, gather_ids=ids)
    assert order == [("read", 3), "forward"]
    order.clear()
    plain = head(hidden, weight, labels, temperature=0.7, gather_ids=ids, check_labels=False)
    assert order == ["forward"]  # nothing to check: no read at all
    assert torch.equal(out.log_probs, plain.log_probs)
    assert torch.equal(out.gathered, plain.gathered)


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_check_is_named_and_the_backend_never_runs(spied, device):
    head, order = spied(device)
    hidden, weight, labels = _case(device)
    bad_labels = labels.clone()
    bad_labels[5] = 611
    ids = torch.zeros(40, 2, dtype=torch.long, device=device)
    bad_ids = ids.clone()
    bad_ids[6, 1] = -3
    bad_t = torch.full((40,), 0.7, device=device)
    bad_t[7] = 0.0
    for y, g, t, words in (
        (bad_labels, ids, 1.0, ["labels must be in [0, 611)", "got 611 at flat position 5"]),
        (bad_labels, bad_ids, 1.0, ["labels must be in [0, 611)"]),  # labels named first
        (labels, bad_ids, 1.0, ["gather_ids must be in [0, 611)", "got -3 at flat row 6, position 1"]),
        (labels, ids, bad_t, ["temperature tensor must hold finite values > 0"]),
    ):  # fmt: skip
        with pytest.raises(ValueError) as info:
            head(hidden, weight, y, gather_ids=g, temperature=t)
        for word in words:
            assert word in str(info.value)
    assert "forward" not in order
