"""The kit's policy-loss properties pass a correct backend and fail each wrong one on the property it breaks."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any, ClassVar

import pytest

from fusedhead import registry
from fusedhead.protocol import KL_ESTIMATORS
from fusedhead.testing import Outcome, check, check_property
from fusedhead.testing.policy import POLICY_PROPERTIES


@pytest.fixture
def policy_backends() -> Iterator[ModuleType]:
    """The correct and wrong policy backends of ``policy_kit_backends.py``, registered in-process."""
    import policy_kit_backends

    policy_kit_backends.register_all()
    yield policy_kit_backends
    policy_kit_backends.unregister_all()


def test_the_correct_backend_passes_every_policy_property(policy_backends: ModuleType) -> None:
    results = check("policy-ref", properties=list(POLICY_PROPERTIES))
    assert [r.outcome for r in results] == [Outcome.PASS] * len(POLICY_PROPERTIES), [
        r.line() for r in results
    ]


def test_a_correct_backend_with_per_token_temperatures_and_a_floor_above_them_passes(
    policy_backends: ModuleType,
) -> None:
    """min_temperature 2 with per-token temperatures: before, policy_loss_ignored_rows called it
    with the kit's own 0.5 to 1.5, not raised to the floor, and held it to the raised ones."""
    results = check("policy-hot-per-token", properties=list(POLICY_PROPERTIES))
    assert [r.outcome for r in results] == [Outcome.PASS] * len(POLICY_PROPERTIES), [
        r.line() for r in results
    ]


@pytest.mark.parametrize(
    ("backend", "prop", "words"),
    [
        ("wrong-policy-dual-clip", "policy_loss_accuracy", ["dual_clip 1.8", "grad"]),
        ("wrong-policy-entropy-grad", "policy_loss_accuracy", ["entropy_coef", "grad"]),
        ("wrong-policy-mask", "policy_loss_ignored_rows", ["NaN/Inf", "grad hidden"]),
        (  # before: only a wrong value, "grad hidden of micro-batch 1 abs err ..."
            "wrong-policy-buffers",
            "policy_loss_upstream_scale",
            ["grad hidden share memory", "handed out one buffer twice"],
        ),
        (  # before: passed, a backward after each call hiding the reuse
            "wrong-policy-weight-buffer",
            "policy_loss_upstream_scale",
            ["both forwards, then one backward", "grad weight accumulated"],
        ),
        ("wrong-policy-determinism", "policy_loss_determinism", ["grad weight", "bitwise"]),
        ("wrong-policy-grads", "policy_loss_contract", ["requires grad", "not asked for"]),
        (  # before: passed, no property compared the inputs after a call
            "wrong-policy-writes-advantages",
            "policy_loss_contract",
            ["check_labels=False", "wrote the caller's advantages"],
        ),
        (  # before: passed, no log-ratio past the clamp at 20 (the kit's were within 0.9)
            "wrong-policy-ratio-clamp",
            "policy_loss_accuracy",
            ["log-ratios of +25", "grad hidden", "got", "expected"],
        ),
        (  # before: passed, every k3 value either about 0.02 or past 10
            "wrong-policy-k3-clamp",
            "policy_loss_accuracy",
            ["k3", "grad hidden"],
        ),
        ("wrong-policy-label-entropy", "policy_loss_accuracy", ["entropy_coef", "grad"]),
        (  # before: passed, no NaN in any per-token input but hidden
            "wrong-policy-cleans-old",
            "policy_loss_contract",
            ["per-token inputs at the ignored rows", "wrote the caller's old_log_probs"],
        ),
        (  # before: passed, the core handing the backend's tensors on where every row is scored
            "wrong-policy-statistics-buffer",
            "policy_loss_contract",
            ["its log_probs changed when a later call ran", "fresh tensors each call"],
        ),
    ],
)
def test_each_wrong_backend_fails_its_property(
    policy_backends: ModuleType, backend: str, prop: str, words: list[str]
) -> None:
    result = check_property(prop, backend)
    assert result.outcome is Outcome.FAIL, result.line()
    for word in words:
        assert word in result.line()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_entropy_counted_twice_at_the_label_is_caught_in_16_bits(
    policy_backends: ModuleType, dtype: str
) -> None:
    """Before, it passed in fp16 and bf16: entropy_coef was 0.02 at most and the labels random,
    so the extra ``g_H p (log p + H)`` hid under the 16-bit bounds. Confident labels and a large
    bonus show it."""
    result = check_property("policy_loss_accuracy", "wrong-policy-label-entropy", dtype=dtype)
    assert result.outcome is Outcome.FAIL, result.line()
    assert "argmax labels" in result.line() and "entropy_coef 0.5" in result.line()
    assert check_property("policy_loss_accuracy", "policy-ref", dtype=dtype).outcome is Outcome.PASS


def test_the_wrong_backends_pass_the_properties_they_do_not_break(
    policy_backends: ModuleType,
) -> None:
    """Each breach is caught by its own property, not only as a wrong value somewhere else (the
    backends with wrong gradients are left out: every property that checks values sees them)."""
    for cls, prop in policy_backends.WRONG.items():
        if prop == "policy_loss_accuracy":
            continue
        for other in POLICY_PROPERTIES:
            if other == prop:
                continue
            result = check_property(other, cls.name)
            assert result.outcome is Outcome.PASS, f"{cls.name}: {result.line()}"


def test_a_backend_without_the_capability_is_not_run_with_the_reason(
    policy_backends: ModuleType,
) -> None:
    for prop in POLICY_PROPERTIES:
        result = check_property(prop, "policy-undeclared")
        assert result.outcome is Outcome.NOT_RUN, result.line()
        assert "does not declare policy_loss" in result.message
        # its policy_loss() method is there: most likely the declaration was forgotten
        assert "although it defines a policy_loss() method" in result.message


def test_determinism_is_not_run_where_it_is_not_declared(policy_backends: ModuleType) -> None:
    from fusedhead import registry

    class Undetermined(policy_backends.PolicyRef):
        name = "policy-undetermined"
        declared: ClassVar[dict[str, Any]] = {"policy_loss": True}

    registry.register_backend(Undetermined.name, Undetermined, replace=True)
    registry.refresh()
    try:
        result = check_property("policy_loss_determinism", Undetermined.name)
        assert result.outcome is Outcome.NOT_RUN, result.line()
        assert "does not declare deterministic" in result.message
    finally:
        registry.unregister_backend(Undetermined.name)
        registry.refresh()


def test_fusedhead_info_shows_the_capability(
    policy_backends: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    from fusedhead import cli

    for name, shown in (("policy-ref", "True"), ("policy-undeclared", "False")):
        assert cli.main(["info", name, "--device", "cpu"]) == 0
        assert f"  policy_loss: {shown}\n" in capsys.readouterr().out


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_the_accuracy_property_checks_the_gradient_of_every_kl_estimator(
    policy_backends: ModuleType, estimator: str
) -> None:
    """A backend whose gradients leave out one estimator's KL fails ``policy_loss_accuracy`` on
    that estimator (before, ``abs`` and ``abs+`` were never called, and such a backend passed)."""
    cls = policy_backends.without_kl_gradient(estimator)
    registry.register_backend(cls.name, cls, replace=True)
    try:
        result = check_property("policy_loss_accuracy", cls.name)
    finally:
        registry.unregister_backend(cls.name)
    assert result.outcome is Outcome.FAIL, result.line()
    assert "grad" in result.line() and estimator in result.line(), result.line()
