"""``torch.compile``: the liger call runs eagerly behind one graph break, and says so.

liger-kernel's functions check the labels on the host (a data-dependent ``bool(tensor)``), so no
Liger call goes into a graph: ``fullgraph=False`` compiles the rest of the step around it, with
the eager values, and ``fullgraph=True`` stops with the reason rather than with Dynamo refusing
``importlib.import_module`` inside the adapter.
"""

from __future__ import annotations

import pytest
import torch

from fusedhead import registry
from fusedhead.protocol import call_backend

pytest.importorskip(
    "fusedhead_liger",
    reason="the liger backend is not installed (pip install ./plugins/liger_backend)",
)
from fusedhead_liger import LigerBackend, LigerOptions

OPTIONS = {"implementation": "fallback"}


def inputs():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(16, 8, generator=gen)
    weight = torch.randn(32, 8, generator=gen)
    labels = torch.randint(0, 32, (16,), generator=gen)
    labels[3] = -100
    return hidden, weight, labels


def step(hidden, weight, labels):
    from fusedhead import fused_head

    out = fused_head(hidden, weight, labels, backend="liger", temperature=0.7, options=OPTIONS)
    return out.log_probs, out.entropy


@pytest.fixture(autouse=True)
def fresh_dynamo():
    registry.refresh()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_step_matches_eager_with_a_graph_break() -> None:
    hidden, weight, labels = inputs()
    h = hidden.clone().requires_grad_()
    lp, ent = step(h, weight, labels)
    (dh,) = torch.autograd.grad((lp * 2 + ent).sum(), h)
    hc = hidden.clone().requires_grad_()
    clp, cent = torch.compile(step, fullgraph=False)(hc, weight, labels)
    (cdh,) = torch.autograd.grad((clp * 2 + cent).sum(), hc)
    assert torch.equal(clp, lp) and torch.equal(cent, ent) and torch.equal(cdh, dh)


def test_fullgraph_names_the_reason() -> None:
    hidden, weight, labels = inputs()
    with pytest.raises(Exception) as info:  # Dynamo's Unsupported, carrying our reason
        torch.compile(step, fullgraph=True)(hidden, weight, labels)
    assert "backend 'liger' does not trace under torch.compile(fullgraph=True)" in str(info.value)
    assert "compile with fullgraph=false" in str(info.value).lower()
    from fusedhead_liger import _untraced

    assert _untraced.REASON in str(info.value)


def test_check_records_the_pair_so_forward_does_not_check_again(monkeypatch) -> None:
    """forward re-ran check() (and its imports) when only the core had checked the pair, which
    Dynamo cannot trace; check() itself now records it."""
    backend = LigerBackend(LigerOptions(implementation="fallback"))
    backend.check(torch.device("cpu"), torch.float32)
    assert (torch.device("cpu"), torch.float32) in backend._checked

    def again(*args):
        raise AssertionError("check() ran again in forward")

    monkeypatch.setattr(backend, "check", again)
    hidden, weight, labels = inputs()
    lp, _ = call_backend(backend,
        hidden, weight, labels, temperature=0.7, ignore_index=-100, return_entropy=True,
        process_group=None, vocab_start=0, vocab_size=32, reduce_hidden_grad=True,
    )  # fmt: skip
    assert torch.isfinite(lp).all()
