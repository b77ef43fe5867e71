"""On CUDA a call's value checks are read after the head's kernels are queued, with the same errors.

The label, id and temperature checks compute their flags on the GPU; the host reads them once, after
the backend's ``forward`` has launched its kernels, so the GPU never waits for the host.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fusedhead import FusedHead

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _case(n: int = 40, h: int = 32, v: int = 611) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).cuda()
    weight = (torch.randn(v, h, generator=g) / h**0.5).cuda()
    labels = torch.randint(0, v, (n,), generator=g).cuda()
    return hidden, weight, labels


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[str]]:
    """The torch backend's head, and the order of its forward calls and the host's flag reads."""
    order: list[str] = []
    head = FusedHead(backend="torch", device="cuda")
    real_forward = head.backend.forward

    def forward(call: Any) -> Any:
        order.append("forward")
        return real_forward(call)

    real_sync = torch.cuda.Event.synchronize

    def synchronize(event: torch.cuda.Event) -> None:
        order.append("read")
        real_sync(event)

    monkeypatch.setattr(head.backend, "forward", forward)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", synchronize)
    return head, order


def test_a_good_call_reads_its_flags_once_after_the_forward(spied):
    head, order = spied
    hidden, weight, labels = _case()
    ids = torch.zeros(40, 3, dtype=torch.long, device="cuda")
    out = head(hidden, weight, labels, temperature=torch.full((40,), 0.7, device="cuda"),
               gather_ids=ids)  # fmt: skip
    assert order == ["forward", "read"]  # labels, ids and temperatures: one read
    plain = head(hidden, weight, labels, temperature=0.7, gather_ids=ids, check_labels=False)
    assert torch.equal(out.log_probs, plain.log_probs)
    assert torch.equal(out.gathered, plain.gathered)


def test_a_bad_label_raises_the_same_error_after_the_forward(spied):
    head, order = spied
    hidden, weight, labels = _case()
    labels[5] = 611
    with pytest.raises(ValueError) as info:
        head(hidden, weight, labels)
    assert "labels must be in [0, 611)" in str(info.value)
    assert "got 611 at flat position 5" in str(info.value)
    assert order == ["forward", "read"]


def test_labels_are_named_before_ids_and_ids_before_nothing(spied):
    head, _ = spied
    hidden, weight, labels = _case()
    bad_labels = labels.clone()
    bad_labels[5] = 611
    ids = torch.zeros(40, 2, dtype=torch.long, device="cuda")
    bad_ids = ids.clone()
    bad_ids[6, 1] = -3
    for y, g, words in (
        (bad_labels, bad_ids, ["labels must be in [0, 611)"]),
        (labels, bad_ids, ["gather_ids must be in [0, 611)", "got -3 at flat row 6, position 1"]),
    ):
        with pytest.raises(ValueError) as info:
            head(hidden, weight, y, gather_ids=g)
        for word in words:
            assert word in str(info.value)


def test_a_bad_per_token_temperature_is_named(spied):
    head, order = spied
    hidden, weight, labels = _case()
    temperature = torch.full((40,), 0.7, device="cuda")
    temperature[7] = 0.0
    with pytest.raises(ValueError, match="temperature tensor must hold finite values > 0"):
        head(hidden, weight, labels, temperature=temperature)
    assert order == ["forward", "read"]


def test_a_failed_check_is_named_when_the_backend_then_fails(spied, monkeypatch):
    head, _ = spied

    def broken(call: Any) -> Any:
        raise RuntimeError("the backend broke on the bad label")

    monkeypatch.setattr(head.backend, "forward", broken)
    hidden, weight, labels = _case()
    labels[2] = -5
    with pytest.raises(ValueError, match="got -5 at flat position 2") as info:
        head(hidden, weight, labels)
    assert isinstance(info.value.__context__, RuntimeError)


def test_checks_under_cuda_graph_capture_are_refused_by_name():
    head = FusedHead(backend="torch", device="cuda")
    hidden, weight, labels = _case()
    head(hidden, weight, labels, check_labels=False)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="check_labels=False"), torch.cuda.graph(graph):
        head(hidden, weight, labels)


def test_an_unchecked_call_with_a_temperature_tensor_is_captured_and_replayed():
    """check_labels=False reads no value, the per-token temperature's included: such a call can
    be captured in a CUDA graph (it used to read the temperature's flag and be refused)."""
    head = FusedHead(backend="torch", device="cuda", options={"skip_ignored_rows": False})
    hidden, weight, labels = _case()
    temperature = torch.full((40,), 0.7, device="cuda")
    temperature[::3] = 1.3
    want = head(hidden, weight, labels, temperature=temperature)  # checked, eagerly
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream, as capture wants
        head(hidden, weight, labels, temperature=temperature, check_labels=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = head(hidden, weight, labels, temperature=temperature, check_labels=False)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=0)
    temperature.fill_(0.9)  # the graph reads the tensor in place: replays see new values
    graph.replay()
    torch.cuda.synchronize()
    again = head(hidden, weight, labels, temperature=temperature)
    torch.testing.assert_close(got.log_probs, again.log_probs, rtol=0, atol=0)
