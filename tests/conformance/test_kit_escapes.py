"""The kit's own verdicts cannot be dodged: ignored rows' NaN/Inf hidden states must reach
nothing, a backend raising the kit's NotRun or PropertyFailure fails the property, and an
unknown property name is a ValueError from ``check`` as from ``check_property``."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from fusedhead.testing import PROPERTIES, Outcome, check, check_property
from fusedhead.testing import contract as kit_contract
from fusedhead.testing.outputs import OUTPUT_PROPERTIES
from fusedhead.testing.policy import POLICY_PROPERTIES

#: Properties not run for these backends, with the kit's own reason (capability not declared).
UNDECLARED = {*OUTPUT_PROPERTIES, *POLICY_PROPERTIES}
#: Slow or spawned: run once, below.
APART = {"vocab_parallel", "hypothesis_cases"}
#: Properties that run a backward (a backend raising only there fails them).
BACKWARD = {
    "backward_accuracy",
    "temperature",
    "input_layouts",
    "ignore_index",
    "requires_grad",
    "inputs_unchanged",
    "determinism",
    "per_token_temperature",
    "softcap",
}


@pytest.fixture
def dodging(kit_backends: ModuleType) -> Iterator[ModuleType]:
    """The backends of ``dodging_backends.py``, registered in-process."""
    import dodging_backends

    dodging_backends.register_all()
    yield dodging_backends
    dodging_backends.unregister_all()


def test_nan_and_inf_hidden_states_at_ignored_rows_must_reach_nothing(dodging, monkeypatch):
    """``0 * row`` instead of selecting the row out: exactly 0 on finite inputs (the clean case
    passes), NaN gradients once an ignored row's hidden state is NaN or Inf."""
    name = dodging.UnmaskedIgnoredRows.name
    result = check_property("ignore_index", name)
    assert result.outcome is Outcome.FAIL, result.line()
    assert "NaN/+Inf/-Inf hidden states at the 14 ignored rows" in result.message
    assert "grad hidden of ignored rows must be exactly 0" in result.message
    monkeypatch.setattr(kit_contract, "poison_ignored", lambda case, index: case)
    assert check_property("ignore_index", name).outcome is Outcome.PASS  # before: passed


@pytest.mark.parametrize("backend", ["torch", "kit-ref"])
def test_a_backend_that_selects_ignored_rows_out_passes(kit_backends, backend):
    result = check_property("ignore_index", backend)
    assert result.outcome is Outcome.PASS, result.line()


@pytest.mark.parametrize(
    ("backend", "raised"),
    [
        ("dodge-notrun-forward", "NotRun"),
        ("dodge-failure-forward", "PropertyFailure"),
        ("dodge-notrun-backward", "NotRun"),
    ],
)
def test_the_kits_own_exceptions_from_the_backend_fail_every_property(dodging, backend, raised):
    """Every property that calls the backend fails, naming it; only undeclared ones are not run."""
    names = [p for p in PROPERTIES if p not in APART]
    results = {r.name: r for r in check(backend, properties=names)}
    not_run = {n for n, r in results.items() if r.outcome is Outcome.NOT_RUN}
    assert not_run == UNDECLARED & set(names), [results[n].line() for n in not_run]
    failed = {n for n, r in results.items() if r.outcome is Outcome.FAIL}
    # raising in backward alone, the backend is caught by every property that runs one
    caught = BACKWARD if backend == "dodge-notrun-backward" else set(names) - UNDECLARED
    assert failed >= caught, sorted(caught - failed)
    for name in caught:
        assert f"the backend {backend!r} raised the kit's own {raised}" in results[name].message


@pytest.mark.parametrize("prop", sorted(APART))
def test_the_kits_notrun_from_the_backend_fails_the_spawned_and_randomized_properties(
    dodging, prop
):
    result = check_property(prop, "dodge-notrun-forward")
    assert result.outcome is Outcome.FAIL, result.line()
    assert "raised the kit's own NotRun" in result.message


def test_a_result_that_changes_on_hypothesis_replay_is_reported_as_the_backends(dodging):
    """Before: "the backend raised FlakyFailure: Hypothesis ... produces unreliable results",
    hypothesis's own exception, as if the backend had raised it."""
    result = check_property("hypothesis_cases", "wrong-only-once")
    assert result.outcome is Outcome.FAIL, result.line()
    assert "FlakyFailure" not in result.message, result.message
    assert "results differ from run to run on the same inputs" in result.message, result.message
    assert "log_probs" in result.message, result.message  # the failure itself


def test_determinism_and_batch_invariance_are_not_dodged(dodging):
    """The tester's case: both called the backend unwrapped, so its NotRun read 'not run'."""
    for result in check("dodge-notrun-forward", properties=["determinism", "batch_invariance"]):
        assert result.outcome is Outcome.FAIL, result.line()
        assert (
            "'dodge-notrun-forward' raised the kit's own NotRun(not applicable)" in result.message
        )


@pytest.mark.parametrize("run", [check, check_property])
def test_an_unknown_property_is_a_value_error_naming_it_and_the_closest(run):
    with pytest.raises(ValueError) as info:
        if run is check:
            check("torch", properties=["forward_acc"])
        else:
            check_property("forward_acc", "torch")
    message = str(info.value)
    assert "unknown property 'forward_acc'" in message
    assert "did you mean 'forward_accuracy'?" in message
    assert "backward_accuracy" in message  # the valid ones


def test_an_unknown_property_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="'ignore_idx'"):
        check("torch", properties=["forward_accuracy", "ignore_idx"])
