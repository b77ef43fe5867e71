"""The kit's output properties pass a correct backend and fail each wrong one on the property it breaks."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from fusedhead.testing import Outcome, check, check_property
from fusedhead.testing.outputs import OUTPUT_PROPERTIES


def test_the_correct_backend_passes_every_output_property(output_backends):
    results = {r.name: r for r in check("outputs-ref", properties=list(OUTPUT_PROPERTIES))}
    failed = [r.line() for r in results.values() if r.outcome is Outcome.FAIL]
    assert not failed
    not_run = {n for n, r in results.items() if r.outcome is Outcome.NOT_RUN}
    assert not_run == {"batch_invariant_extras"}


def test_a_batch_invariant_backend_passes_the_batch_invariance_of_its_extras(output_backends):
    result = check_property("batch_invariant_extras", "outputs-ref-rowwise")
    assert result.outcome is Outcome.PASS, result.line()


@pytest.mark.parametrize(
    ("backend", "prop", "words"),
    [
        ("wrong-topk-ties", "topk_accuracy", ["integer logits", "lower id"]),
        ("wrong-argmax-ignored", "argmax_accuracy", ["argmax of ignored rows must be -1"]),
        ("wrong-gather-ignored", "gather_accuracy", ["gathered of ignored rows must be exactly 0"]),
        ("wrong-gather-bits", "gather_accuracy", ["bitwise"]),
        ("wrong-lse-grad", "lse_and_sum_p2", ["upstream gradient through", "grad"]),
        ("wrong-sum-p2", "lse_and_sum_p2", ["sum_p2"]),
        ("wrong-extras-padded", "extras_together", ["V=1037", "lse"]),
        ("wrong-kl-teacher-grad", "kl_accuracy", ["teacher", "gradient"]),
        ("wrong-kl-direction", "kl_accuracy", ["reverse KL", "kl abs err"]),
        ("wrong-kl-teacher-softcap", "kl_accuracy", ["teacher softcap 3.0", "kl abs err"]),
        ("wrong-extras-batch", "batch_invariant_extras", ["lse", "bitwise"]),
    ],
)
def test_each_wrong_backend_fails_its_property(output_backends, backend, prop, words):
    result = check_property(prop, backend)
    assert result.outcome is Outcome.FAIL, result.line()
    for word in words:
        assert word in result.line()


def test_the_wrong_backends_pass_the_properties_they_do_not_break(output_backends):
    for cls, prop in output_backends.WRONG.items():
        for other in ("topk_accuracy", "gather_accuracy", "kl_accuracy"):
            if other == prop or (cls.name, other) in {("wrong-gather-bits", "gather_accuracy")}:
                continue
            result = check_property(other, cls.name)
            assert result.outcome is Outcome.PASS, f"{cls.name}: {result.line()}"


def test_output_properties_are_not_run_where_the_outputs_are_not_declared(output_backends):
    from fusedhead import registry

    class Plain(output_backends.OutputsRef):
        name = "outputs-none"

        def capabilities(self, device):
            return (
                super()
                .capabilities(device)
                .model_copy(update={"outputs": ("log_probs", "entropy"), "kl_directions": ()})
            )

    registry.register_backend(Plain.name, Plain, replace=True)
    registry.refresh()
    try:
        for prop in OUTPUT_PROPERTIES:
            result = check_property(prop, "outputs-none")
            assert result.outcome is Outcome.NOT_RUN, result.line()
            assert "does not declare" in result.message
    finally:
        registry.unregister_backend(Plain.name)
        registry.refresh()


@pytest.mark.parametrize("floor", [0.1, 2.5])
def test_a_backend_declaring_a_min_temperature_passes_every_output_property(output_backends, floor):
    """The output properties' temperatures (fixed ones, per-token ones, the KL's two heads') stay
    at or above a declared min_temperature: no call the core would refuse."""
    from fusedhead import registry

    class Floored(output_backends.OutputsRef):
        name = "outputs-floored"
        declared: ClassVar[dict[str, Any]] = {"min_temperature": floor}

    registry.register_backend(Floored.name, Floored, replace=True)
    registry.refresh()
    try:
        results = check("outputs-floored", properties=list(OUTPUT_PROPERTIES))
        failed = [r.line() for r in results if r.outcome is Outcome.FAIL]
        assert not failed
    finally:
        registry.unregister_backend(Floored.name)
        registry.refresh()
