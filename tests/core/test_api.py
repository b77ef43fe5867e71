"""fused_head and FusedHead: results of the named backend, resolved once, observed by hooks."""

from __future__ import annotations

import pytest
import torch

from fusedhead import FusedHead, FusedHeadConfig, fused_head
from fusedhead.hooks import hookimpl, register_hooks, unregister_hooks
from fusedhead.reference import reference_fused_head


class Observer:
    def __init__(self, veto: bool = False) -> None:
        self.seen: list[dict] = []
        self.veto = veto

    @hookimpl
    def fusedhead_backend_resolved(self, name, distribution, version, options, capabilities):
        self.seen.append(
            {"name": name, "distribution": distribution, "options": options, "caps": capabilities}
        )
        if self.veto:
            raise RuntimeError("only batch-invariant backends in evaluation")


@pytest.fixture
def observer():
    obs = Observer()
    register_hooks(obs)
    yield obs
    unregister_hooks(obs)


def test_fused_head_matches_the_reference(ref_backend, inputs):
    h, w, y = inputs(n=10)
    y[4] = -100
    out = fused_head(h, w, y, backend="ref-test", temperature=0.7)
    lp, ent = reference_fused_head(h, w, y, temperature=0.7, compute_dtype=torch.float64)
    assert out.log_probs.dtype == torch.float32 and out.entropy is not None
    torch.testing.assert_close(out.log_probs.double(), lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.entropy.double(), ent, rtol=1e-5, atol=1e-6)


def test_return_entropy_false_gives_none(ref_backend, inputs):
    out = fused_head(*inputs(), backend="ref-test", return_entropy=False)
    assert out.entropy is None and out.log_probs.shape == (6,)


def test_functional_calls_resolve_once_and_notify_observers(ref_backend, observer, inputs):
    for _ in range(3):
        fused_head(*inputs(), backend="ref-test", options={"tag": "q"})
    assert len(observer.seen) == 1
    assert observer.seen[0]["name"] == "ref-test" and observer.seen[0]["options"] == {"tag": "q"}
    assert observer.seen[0]["distribution"] is None


def test_observer_can_veto_a_resolution(ref_backend):
    obs = Observer(veto=True)
    register_hooks(obs)
    try:
        with pytest.raises(RuntimeError, match="evaluation"):
            FusedHead(FusedHeadConfig(backend="ref-test"))
    finally:
        unregister_hooks(obs)


def test_fused_head_object_uses_config_defaults(ref_backend, inputs):
    head = FusedHead(FusedHeadConfig(backend="ref-test", temperature=2.0, return_entropy=False))
    h, w, y = inputs()
    out = head(h, w, y)
    lp, _ = reference_fused_head(h, w, y, temperature=2.0, compute_dtype=torch.float64)
    torch.testing.assert_close(out.log_probs.double(), lp, rtol=1e-5, atol=1e-6)
    assert out.entropy is None


def test_default_backend_is_the_fixed_name_torch(monkeypatch):
    import inspect

    assert inspect.signature(fused_head).parameters["backend"].default == "torch"
    assert FusedHeadConfig.model_fields["backend"].default == "torch"


def test_gradients_flow_to_whichever_input_requires_them(ref_backend, inputs):
    h, w, y = inputs()
    h.requires_grad_()
    out = fused_head(h, w, y, backend="ref-test")
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert h.grad is not None and w.grad is None
