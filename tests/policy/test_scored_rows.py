"""A checked policy-loss call computes only the rows that count (``fusedhead.scored_rows``).

The number of scored rows comes with the value checks' one host read; the backend is handed those
rows alone, and the outputs are the whole batch's: every statistic the unchecked call (which hands
the backend every row) gives, zeros and zero hidden gradient at ignored rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from policy_backends import POLICY_BACKENDS

import fusedhead
from fusedhead.protocol import PolicyLossCall


def _batch(per_token_temperature: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    b, s, h, v = 3, 9, 16, 70
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[0, 5:] = -100  # padding
    labels[1, :3] = -100  # a prompt
    hidden = torch.randn(b, s, h, generator=g)
    hidden[0, 6, 2] = float("nan")  # an ignored row's NaN reaches nothing
    temp: float | torch.Tensor = 0.7
    if per_token_temperature:
        temp = 0.5 + torch.rand(b, s, generator=g)
    return {
        "hidden": hidden,
        "weight": torch.randn(v, h, generator=g) / 3,
        "labels": labels,
        "old_log_probs": -4 + torch.randn(b, s, generator=g),
        "advantages": torch.randn(b, 1, generator=g),
        "ref_log_probs": -4 + torch.randn(b, s, generator=g),
        "rollout_log_probs": -4 + torch.randn(b, s, generator=g),
        "temperature": temp,
    }


def _run(head: fusedhead.FusedHead, x: dict[str, Any]) -> tuple[Any, torch.Tensor, torch.Tensor]:
    hid = x["hidden"].clone().requires_grad_()
    w = x["weight"].clone().requires_grad_()
    rest = {k: v for k, v in x.items() if k not in ("hidden", "weight", "labels")}
    out = head.policy_loss(
        hid, w, x["labels"], tis_cap=2.0, entropy_coef=0.01, kl_coef=0.1, dual_clip=3.0,
        aggregation="seq-mean-token-mean", **rest,
    )  # fmt: skip
    out.loss.backward()
    assert hid.grad is not None and w.grad is not None
    return out, hid.grad, w.grad


def _spy(head: fusedhead.FusedHead, seen: list[PolicyLossCall]) -> None:
    backend = head.backend
    inner = backend.policy_loss

    def policy_loss(call: PolicyLossCall) -> Any:
        seen.append(call)
        return inner(call)

    backend.policy_loss = policy_loss


@pytest.mark.parametrize("per_token_temperature", [False, True])
@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_the_backend_sees_the_scored_rows_and_the_outputs_are_the_whole_batchs(
    backend: str, per_token_temperature: bool
) -> None:
    x = _batch(per_token_temperature)
    checked = fusedhead.FusedHead({"backend": backend})
    unchecked = fusedhead.FusedHead({"backend": backend, "check_labels": False})
    _run(checked, x)  # resolves the backend, so the spy can wrap it
    _run(unchecked, x)
    seen: list[PolicyLossCall] = []
    _spy(checked, seen)
    _spy(unchecked, seen)
    got, gh, gw = _run(checked, x)
    want, wh, ww = _run(unchecked, x)
    scored = x["labels"] != -100
    (part, whole) = seen
    assert part.head.hidden.shape[0] == int(scored.sum()) < whole.head.hidden.shape[0] == 27
    assert bool((part.head.labels != -100).all())
    assert torch.equal(part.head.labels, x["labels"][scored])
    if per_token_temperature:
        assert isinstance(part.head.temperature, torch.Tensor)
        assert torch.equal(part.head.temperature, x["temperature"][scored].float())
    # Rows are independent: a scored row's statistics are its bits in the whole batch.
    assert torch.equal(got.log_probs, want.log_probs)
    assert torch.equal(got.entropy, want.entropy)
    for name in ("loss", "pg_loss", "entropy_loss", "kl", "clip_fraction", "ratio_max"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-6, atol=0)
    assert torch.equal(gh[~scored], torch.zeros_like(gh[~scored]))
    torch.testing.assert_close(gh, wh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_inside_torch_compile_the_backend_sees_the_scored_rows_as_in_eager_mode(
    backend: str,
) -> None:
    """The count is data-dependent, so a compiled graph cannot read it; the backend's call (a
    graph break) reads it instead: a compiled step skips the ignored rows as an eager one does."""
    x = _batch(False)
    head = fusedhead.FusedHead({"backend": backend})
    _run(head, x)
    seen: list[PolicyLossCall] = []
    _spy(head, seen)
    torch._dynamo.reset()
    eager, _, eager_w = _run(head, x)
    compiled, _, compiled_w = torch.compile(_run, backend="eager")(head, x)
    scored = int((x["labels"] != -100).sum())
    assert [c.head.hidden.shape[0] for c in seen] == [scored, scored]
    assert torch.equal(compiled.loss, eager.loss)
    assert torch.equal(compiled_w, eager_w)


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_no_scored_row_gives_zeros_without_running_the_backend(backend: str) -> None:
    x = _batch(False)
    x["labels"] = torch.full_like(x["labels"], -100)
    head = fusedhead.FusedHead({"backend": backend})
    _run(head, _batch(False))
    seen: list[PolicyLossCall] = []
    _spy(head, seen)
    out, gh, gw = _run(head, x)
    assert seen == []
    assert float(out.loss.detach()) == 0.0
    assert not bool(out.log_probs.any()) and not bool(out.entropy.any())
    assert not bool(gh.any()) and not bool(gw.any())


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_every_row_scored_hands_the_backend_the_call_as_it_is(backend: str) -> None:
    x = _batch(False)
    x["labels"] = x["labels"].clamp(min=0)
    x["hidden"] = x["hidden"].nan_to_num()
    head = fusedhead.FusedHead({"backend": backend})
    _run(head, x)
    seen: list[PolicyLossCall] = []
    _spy(head, seen)
    _run(head, x)
    assert seen[0].head.hidden.shape[0] == 27


@pytest.mark.parametrize("per_token_temperature", [False, True])
def test_the_count_comes_with_the_value_checks_in_their_one_host_read(
    monkeypatch: pytest.MonkeyPatch, per_token_temperature: bool
) -> None:
    x = _batch(per_token_temperature)
    head = fusedhead.FusedHead({"backend": "torch"})
    _run(head, x)
    reads: list[list[int]] = []
    real = torch.Tensor.tolist

    def tolist(t: torch.Tensor) -> Any:
        out = real(t)
        reads.append(out if isinstance(out, list) else [out])
        return out

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    _run(head, x)
    # the labels' range, the loss's values finite; per token, the temperatures' range and
    # torch's min_temperature
    flags = 4 if per_token_temperature else 2
    assert reads == [[0] * flags + [int((x["labels"] != -100).sum())]]


def test_after_the_read_only_the_scored_hidden_rows_are_gathered_before_the_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host latency the GPU waits for: between the value checks' one read and the backend's
    first kernel the core makes one op that is not a view (the scored hidden rows' gather); the
    rows' order and the per-token gathers are queued before the read."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fusedhead.value_checks import Pending

    phase = {"now": "before"}
    ops: dict[str, list[str]] = {"before": [], "after": [], "backend": []}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if not func.is_view:
                ops[phase["now"]].append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    settle = Pending.settle

    def read(self: Pending) -> None:
        settle(self)
        phase["now"] = "after"

    monkeypatch.setattr(Pending, "settle", read)
    head = fusedhead.FusedHead({"backend": "torch"})
    x = _batch(True)
    _run(head, x)
    inner = head.backend.policy_loss

    def policy_loss(call: PolicyLossCall) -> Any:
        phase["now"] = "backend"
        return inner(call)

    head.backend.policy_loss = policy_loss
    phase["now"] = "before"
    for k in ops:
        ops[k].clear()
    with Record():
        _run(head, x)
    assert ops["after"] == ["aten.index_select"], ops["after"]
    # labels, the per-token temperature, old, advantages, token weights, reference, TIS weights
    assert ops["before"].count("aten.index_select") == 7
    assert ops["backend"], "the backend ran"
