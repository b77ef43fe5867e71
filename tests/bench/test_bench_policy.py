"""``fusedhead bench --case policy``: the fused loss, the unfused path and the peers, on tiny CPU problems."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fusedhead import cli
from fusedhead.bench import peers, policy
from fusedhead.bench.cases import Case, make_inputs
from fusedhead.reference import reference_policy_loss

TINY = ["--device", "cpu", "--n", "40", "--hidden", "16", "--vocab", "300", "--reps", "1"]


@pytest.fixture
def torch_backend() -> None:
    pytest.importorskip("fusedhead_torch", reason="needs fusedhead-torch installed")


def test_policy_case_measures_fused_and_unfused_against_float64(
    torch_backend: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    impls = ["torch", "unfused:torch", "reference", "cce", 'liger:{"implementation": "fallback"}']
    rc = cli.main(
        ["bench", *TINY, "--case", "policy", "--impl", *impls, "--no-memory", "--json", str(out)]
    )
    table = capsys.readouterr().out
    assert rc == 0, table
    records = {r["impl"]: r for r in json.loads(out.read_text())}
    for name in ("torch", "unfused:torch", "reference"):
        r = records[name]
        assert r["status"] == "ok", r
        assert r["case"]["head"] == "policy" and r["reference_dtype"] == "float64"
        errors = r["errors"]
        assert errors["loss"]["rel"] <= 1e-5, errors["loss"]
        assert errors["grad_hidden"]["rel"] <= 1e-4 and errors["grad_weight"]["rel"] <= 1e-4
        assert r["fwd_bwd_units"] > 0
    assert records["cce"]["status"] == "skipped"
    assert "computes no entropy" in records["cce"]["reason"]
    liger = next(r for name, r in records.items() if name.startswith("liger"))
    if liger["status"] == "skipped":  # where liger-kernel is installed, its fallback is a backend
        assert "does not declare policy_loss" in liger["reason"] and "unfused:" in liger["reason"]
    assert "loss err" in table and "unfused:torch policy" in table


def test_unfused_runs_the_policy_case_only(torch_backend: None) -> None:
    impl = peers.resolve("unfused:torch")
    assert impl.name == "unfused:torch"
    reason = impl.availability(Case(8, 4, 16))
    assert reason is not None and "policy case only" in reason
    assert impl.availability(Case(8, 4, 16, head="policy")) is None
    with pytest.raises(ValueError, match="unknown implementation 'torhc'"):
        peers.resolve("unfused:torhc")
    with pytest.raises(ValueError, match="installed fusedhead backend"):
        peers.resolve("unfused:reference")


def test_by_default_the_policy_case_weighs_every_backend_against_its_unfused_path(
    torch_backend: None,
) -> None:
    """Issue 31 item 5 in one run without --impl: the fused loss and its four-GEMM path."""
    backends = [s for s in peers.default_specs() if s not in peers.PEERS]
    assert "torch" in backends and not any(s.startswith("unfused:") for s in backends)
    with_policy = peers.default_specs(["logprobs", "policy"])
    assert [s for s in with_policy if s.startswith("unfused:")] == [
        f"unfused:{b}" for b in backends
    ]
    assert with_policy[: len(backends)] == backends


def test_the_blocked_reference_is_the_whole_batchs_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case(37, 8, 50, head="policy", seed=3)
    inputs = make_inputs(case)
    monkeypatch.setattr(policy, "_block_rows", lambda *a: 7)  # six blocks, the last one short
    ref = policy.compute_reference(case, inputs)
    t = policy.terms(case, inputs.hidden, inputs.weight, inputs.labels)
    h = inputs.hidden.double().requires_grad_(True)
    w = inputs.weight.double().requires_grad_(True)
    kw = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in t.kwargs().items()}
    whole = reference_policy_loss(h, w, inputs.labels, temperature=case.temperature, **kw)
    whole.backward()
    assert h.grad is not None and w.grad is not None
    torch.testing.assert_close(ref.loss, whole.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ref.grad_hidden, h.grad, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(ref.grad_weight, w.grad, rtol=1e-10, atol=1e-14)
    # The terms: old and reference log-probs near the current ones, seeded.
    again = policy.terms(case, inputs.hidden, inputs.weight, inputs.labels)
    assert again is t
    lp = t.old_log_probs - t.ref_log_probs
    assert 0.05 < float(lp.std()) < 0.3
