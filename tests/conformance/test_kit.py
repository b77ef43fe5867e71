"""The kit passes a correct backend and fails each wrong one on the property it breaks."""

from __future__ import annotations

import argparse

import pytest

from fusedhead.errors import BackendUnavailableError, OptionsError
from fusedhead.testing import PROPERTIES, Outcome, check, check_property
from fusedhead.testing.outputs import OUTPUT_PROPERTIES
from fusedhead.testing.policy import POLICY_PROPERTIES
from fusedhead.testing.target import Target


def test_correct_backend_passes_every_property_it_declares(kit_backends):
    results = {r.name: r for r in check("kit-ref")}
    assert set(results) == set(PROPERTIES)
    failed = [r.line() for r in results.values() if r.outcome is Outcome.FAIL]
    assert not failed
    not_run = {name for name, r in results.items() if r.outcome is Outcome.NOT_RUN}
    # kit-ref declares everything but batch invariance, and none of the outputs past entropy
    assert not_run == {"batch_invariance", *OUTPUT_PROPERTIES, *POLICY_PROPERTIES}
    assert "does not declare batch_invariant" in results["batch_invariance"].message


@pytest.mark.parametrize("floor", [0.1, 25.0])
def test_a_backend_declaring_a_min_temperature_passes_every_property_at_and_above_it(
    kit_backends, floor
):
    """A declared min_temperature is legal: the kit tests temperatures from it up (the fixed
    0.05..20 range starts there, or is it alone above 20), never one the core refuses."""
    name = kit_backends.MIN_TEMPERATURE[floor].name
    results = {r.name: r for r in check(name)}
    failed = [r.line() for r in results.values() if r.outcome is Outcome.FAIL]
    assert not failed
    assert results["temperature"].outcome is Outcome.PASS
    assert results["hypothesis_cases"].outcome is Outcome.PASS
    assert results["per_token_temperature"].outcome is Outcome.PASS


def test_a_temperature_below_the_declared_minimum_must_be_refused_not_computed(
    kit_backends, monkeypatch
):
    """The temperature property checks the promise both ways: below a declared min_temperature
    the call is a CapabilityError naming it (here the core's refusal is switched off)."""
    from fusedhead import contract

    assert check_property("temperature", "kit-min-temperature").outcome is Outcome.PASS
    monkeypatch.setattr(contract, "_gate_temperature", lambda arg, temp, *a: temp)
    result = check_property("temperature", "kit-min-temperature")
    assert result.outcome is Outcome.FAIL, result.line()
    assert "temperature 0.05 below the declared min_temperature 0.1" in result.message
    assert "computed, expected a CapabilityError" in result.message


@pytest.mark.parametrize(
    ("backend", "prop", "words"),
    [
        ("wrong-padded-vocab", "odd_shapes", ["V=1037", "log_probs"]),
        ("wrong-ignored-rows", "ignore_index", ["ignored rows must be exactly 0"]),
        ("wrong-entropy-grad", "backward_accuracy", ["through entropy only", "grad"]),
        ("wrong-temperature-backward", "temperature", ["temperature", "grad hidden"]),
        ("wrong-batch-invariance", "batch_invariance", ["not bitwise equal"]),
        ("wrong-writes-labels", "inputs_unchanged", ["wrote the caller's labels", "never writes"]),
        (  # before: passed, the kit's cases for this property held no NaN row
            "wrong-cleans-hidden",
            "inputs_unchanged",
            ["check_labels=False", "wrote the caller's hidden"],
        ),
        (  # before: passed, inputs compared through nan_to_num, which maps +Inf to fp32's max
            "wrong-clamps-inf-hidden",
            "inputs_unchanged",
            ["check_labels=False", "wrote the caller's hidden"],
        ),
        ("wrong-reused-outputs", "fresh_outputs", ["changed when a later call ran", "fresh"]),
    ],
)
def test_each_wrong_backend_fails_on_its_property(kit_backends, backend, prop, words):
    result = check_property(prop, backend)
    assert result.outcome is Outcome.FAIL, result.line()
    line = result.line()
    assert line.startswith(f"FAIL {prop}: ")
    for word in words:
        assert word in line


def test_padded_vocabulary_is_caught_only_where_v_is_no_multiple_of_a_tile(kit_backends):
    assert check_property("forward_accuracy", "wrong-padded-vocab").outcome is Outcome.PASS
    assert check_property("odd_shapes", "wrong-padded-vocab").outcome is Outcome.FAIL


def test_batch_invariance_declared_but_absent_is_a_failure_not_a_skip(kit_backends):
    results = {r.name: r for r in check("wrong-batch-invariance")}
    assert results["batch_invariance"].outcome is Outcome.FAIL
    others = [
        r.line()
        for name, r in results.items()
        if name != "batch_invariance" and r.outcome is Outcome.FAIL
    ]
    assert not others, "apart from its false claim, this backend is correct"


def test_undeclared_capabilities_are_not_run_with_the_reason(kit_backends):
    for prop in (
        "determinism",
        "per_token_temperature",
        "softcap",
        "vocab_parallel",
        "batch_invariance",
    ):
        result = check_property(prop, "wrong-padded-vocab")
        assert result.outcome is Outcome.NOT_RUN
        assert "does not declare" in result.message


def test_a_backend_that_cannot_run_here_is_an_error_not_a_pass(kit_backends, monkeypatch):
    def unavailable(self, device, dtype):
        raise BackendUnavailableError("no such accelerator here; install the driver")

    monkeypatch.setattr(kit_backends.KitRef, "check", unavailable)
    with pytest.raises(BackendUnavailableError, match="no such accelerator"):
        Target.resolve("kit-ref")


def _run(argv):
    from fusedhead.testing import runner

    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    return runner.run(parser.parse_args(argv))


def test_runner_prints_one_line_per_property_and_exits_1_on_a_failure(kit_backends, capsys):
    assert _run(["wrong-ignored-rows", "-k", "ignore_index,determinism"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("FAIL ignore_index: ")
    assert lines[2] == "NOT RUN determinism: the backend does not declare deterministic on cpu"
    assert lines[3] == (  # -k matches substrings: policy_loss_determinism too
        "NOT RUN policy_loss_determinism: the backend does not declare policy_loss on cpu"
    )
    assert lines[4].endswith("0 pass, 1 fail, 2 not run")


def test_runner_exits_0_when_nothing_failed(kit_backends, capsys):
    assert _run(["kit-ref", "-k", "forward_accuracy,tiny", "--dtype", "bf16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == ["PASS forward_accuracy", "PASS tiny_batches"]


def test_runner_selection_that_matches_nothing_is_an_error(kit_backends):
    with pytest.raises(ValueError, match="matches no property"):
        _run(["kit-ref", "-k", "no_such_property"])


def test_options_are_validated_against_the_backends_options_model(kit_backends):
    with pytest.raises(OptionsError, match="unknown option 'chunk'") as info:
        Target.resolve("kit-ref", '{"chunk": 3}')
    assert isinstance(info.value, ValueError) and info.value.backend == "kit-ref"


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        (
            "forward,determinsm",
            r"'determinsm' \(did you mean 'determinism'\?\) matches no property",
        ),
        ("forward,", "none empty"),
        ("", "none empty"),
    ],
)
def test_select_refuses_every_part_that_selects_nothing(pattern: str, words: str) -> None:
    """The kit's Python selection refuses what the command line refuses: a part that matches
    nothing (a typo) or an empty one is never dropped while the rest runs."""
    from fusedhead.testing.catalog import PROPERTIES, select

    with pytest.raises(ValueError, match=words):
        select(pattern)
    assert select(None) == list(PROPERTIES)
    assert select("forward_acc, tiny") == ["forward_accuracy", "tiny_batches"]
