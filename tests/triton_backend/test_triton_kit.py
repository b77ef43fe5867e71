"""The conformance kit against the triton backend: fp32 on the CPU interpreter, every property.

(The GPU run of the kit, bf16/fp16/fp32, lives in test_triton_gpu.py.)
"""

from __future__ import annotations

import pytest

from fusedhead.testing import PROPERTIES, Outcome, check_property

SLOW = {"backward_accuracy", "vocab_parallel", "hypothesis_cases"}


@pytest.mark.parametrize(
    "prop", [pytest.param(p, marks=[pytest.mark.slow] if p in SLOW else []) for p in PROPERTIES]
)
def test_kit_property_on_the_cpu_interpreter(prop: str) -> None:
    result = check_property(prop, "triton", device="cpu", dtype="fp32")
    assert result.outcome is Outcome.PASS, result.line()
