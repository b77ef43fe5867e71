"""The kit's bitwise batch-invariance properties under the Triton interpreter on the CPU.

There ``tl.dot`` is NumPy's matmul; on a BLAS whose kernels give a row other bits at another place
in the matrix (OpenBLAS's Haswell/Zen kernels) a batch-invariant kernel reads as varying, so the
kit reports those properties as not run, naming the cause and the fix, instead of failed.
"""

from __future__ import annotations

import platform

import pytest

from fusedhead.testing import interpreter
from fusedhead.testing.outcome import NotRun, PropertyFailure
from fusedhead.testing.target import Target


def _failing(target: Target) -> None:
    raise PropertyFailure("row 3 alone vs the full batch not bitwise equal")


@pytest.fixture
def cpu_target() -> Target:
    return Target.resolve("torch", device="cpu")


def test_a_failure_under_the_interpreter_on_a_varying_blas_is_not_run_with_cause_and_fix(
    cpu_target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(interpreter, "numpy_matmul_row_invariant", lambda: False)
    with pytest.raises(NotRun) as info:
        interpreter.unless_interpreter_dot_varies(_failing)(cpu_target)
    text = str(info.value)
    assert "tl.dot is NumPy's matmul" in text and "row 3 alone" in text
    assert "OPENBLAS_CORETYPE=Sandybridge" in text


@pytest.mark.parametrize(("interpret", "invariant"), [("1", True), ("0", False), ("0", True)])
def test_a_failure_stays_a_failure_where_the_dot_is_not_the_cause(
    cpu_target: Target, monkeypatch: pytest.MonkeyPatch, interpret: str, invariant: bool
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(interpreter, "numpy_matmul_row_invariant", lambda: invariant)
    with pytest.raises(PropertyFailure, match="row 3 alone"):
        interpreter.unless_interpreter_dot_varies(_failing)(cpu_target)


def test_a_passing_property_passes(cpu_target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(interpreter, "numpy_matmul_row_invariant", lambda: False)
    interpreter.unless_interpreter_dot_varies(lambda target: None)(cpu_target)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")
def test_the_test_session_loads_row_invariant_blas_kernels() -> None:
    """tests/conftest.py sets OPENBLAS_CORETYPE=Sandybridge, so the suite's own bitwise checks
    under the interpreter run on every x86-64 CPU (on Haswell/Zen kernels they could not)."""
    interpreter.numpy_matmul_row_invariant.cache_clear()
    assert interpreter.numpy_matmul_row_invariant()
