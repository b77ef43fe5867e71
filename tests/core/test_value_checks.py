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
    # one read of four flags: labels, ids, the temperatures' range, torch's min_temperature
    assert order == [("read", 4), "forward"]
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


# --- check_labels=False: the documented opt-out skips the per-token temperature's check too -----


def _bad_temperature(device: str, n: int = 40) -> torch.Tensor:
    t = torch.full((n,), 0.7, device=device)
    t[7] = 0.0  # out of range: checked, it is named; unchecked, only its row is wrong
    return t


@pytest.fixture
def temperature_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names the temperature value check was asked for (eager and in-graph alike)."""
    from fusedhead import validation, value_checks

    seen: list[str] = []
    real = value_checks.check_temperature_values

    def spy(t: torch.Tensor, arg: str, pending: Any = None) -> None:
        seen.append(arg)
        real(t, arg, pending)

    # validation's eager call and the in-graph op's kernel (value_checks') each name it.
    monkeypatch.setattr(validation, "check_temperature_values", spy)
    monkeypatch.setattr(value_checks, "check_temperature_values", spy)
    return seen


@pytest.mark.parametrize("device", DEVICES)
def test_check_labels_false_reads_no_temperature_value(spied, temperature_checks, device):
    head, order = spied(device)
    hidden, weight, labels = _case(device)
    bad = _bad_temperature(device)
    out = head(hidden, weight, labels, temperature=bad, check_labels=False)
    assert order == ["forward"]  # no host read before the forward: nothing was checked
    assert temperature_checks == []
    good = bad.clone()
    good[7] = 0.7
    ref = head(hidden, weight, labels, temperature=good, check_labels=False)
    keep = torch.arange(40) != 7  # every other row is the checked call's
    assert torch.equal(out.log_probs[keep], ref.log_probs[keep])
    assert torch.equal(out.entropy[keep], ref.entropy[keep])


@pytest.mark.parametrize("device", DEVICES)
def test_the_config_and_fused_head_opt_out_alike(temperature_checks, device):
    from fusedhead import fused_head

    hidden, weight, labels = _case(device)
    bad = _bad_temperature(device)
    FusedHead(backend="torch", check_labels=False)(hidden, weight, labels, temperature=bad)
    fused_head(hidden, weight, labels, temperature=bad, check_labels=False)
    assert temperature_checks == []
    with pytest.raises(ValueError, match="temperature tensor must hold finite values > 0"):
        fused_head(hidden, weight, labels, temperature=bad)  # the default still checks
    with pytest.raises(ValueError, match=r"got 0.0 \(as fp32\) at flat position 7"):
        FusedHead(backend="torch", check_labels=False)(
            hidden, weight, labels, temperature=bad, check_labels=True
        )
    assert temperature_checks == ["temperature", "temperature"]


@pytest.mark.parametrize("device", DEVICES)
def test_check_labels_false_puts_no_temperature_check_in_a_compiled_graph(
    temperature_checks, device
):
    from fusedhead import fused_head

    hidden, weight, labels = _case(device)
    bad = _bad_temperature(device)

    def step(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return fused_head(h, w, y, temperature=t, check_labels=False).log_probs

    def checked(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return fused_head(h, w, y, temperature=t).log_probs

    torch._dynamo.reset()
    torch.compile(step, backend="aot_eager", fullgraph=True)(hidden, weight, labels, bad)
    assert temperature_checks == []
    with pytest.raises(ValueError, match="temperature tensor must hold finite values > 0"):
        torch.compile(checked, backend="aot_eager", fullgraph=True)(hidden, weight, labels, bad)
    assert temperature_checks == ["temperature"]


@pytest.mark.parametrize("device", DEVICES)
def test_the_kl_of_two_heads_opts_out_alike(temperature_checks, device):
    """``fused_kl`` and ``FusedHead.kl`` follow ``check_labels`` as a head call does: unchecked,
    neither head's per-token temperature is read (only the bad row is wrong); checked (the
    default), the bad one is named."""
    from fusedhead import fused_kl

    hidden, weight, labels = _case(device)
    t_hidden, t_weight, _ = _case(device)
    bad = _bad_temperature(device)
    good = bad.clone()
    good[7] = 0.7
    out = fused_kl(hidden, weight, t_hidden, t_weight, labels, temperature=bad,
                   teacher_temperature=bad, check_labels=False)  # fmt: skip
    FusedHead(backend="torch", check_labels=False).kl(
        hidden, weight, t_hidden, t_weight, labels, teacher_temperature=bad
    )
    assert temperature_checks == []
    ref = fused_kl(hidden, weight, t_hidden, t_weight, labels, temperature=good,
                   teacher_temperature=good, check_labels=False)  # fmt: skip
    keep = torch.arange(40) != 7
    assert torch.equal(out[keep], ref[keep])
    with pytest.raises(ValueError, match="teacher_temperature tensor must hold finite values > 0"):
        fused_kl(hidden, weight, t_hidden, t_weight, labels, teacher_temperature=bad)
    with pytest.raises(ValueError, match="temperature tensor must hold finite values > 0"):
        FusedHead(backend="torch", check_labels=False).kl(
            hidden, weight, t_hidden, t_weight, labels, temperature=bad, check_labels=True
        )
    assert temperature_checks == ["teacher_temperature", "temperature"]
