"""The kit's extras and KL properties call with NaN/+-Inf hidden states at the ignored rows: a
backend that computes those rows and drops them after the softmax (its backward NaN there) fails;
the reference backend, which selects them out first, passes."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any, ClassVar

import pytest
import torch

from fusedhead import registry
from fusedhead.protocol import HeadCall, KLCall
from fusedhead.testing import Outcome, check_property


@pytest.fixture
def leaky(output_backends: ModuleType) -> Iterator[str]:
    """``outputs-ref`` without its select-out of ignored rows, registered in-process."""
    scaled: Any = output_backends._scaled

    class Leaky(output_backends.OutputsRef):
        name: ClassVar[str] = "wrong-ignored-rows-leak"

        def logits(self, call: HeadCall) -> torch.Tensor:
            return scaled(call.hidden, call.weight, call.temperature, call.softcap)

        def kl_log_probs(self, call: KLCall) -> tuple[torch.Tensor, torch.Tensor]:
            zs = scaled(call.hidden, call.weight, call.temperature, call.softcap)
            zt = scaled(
                call.teacher_hidden,
                call.teacher_weight,
                call.teacher_temperature,
                call.teacher_softcap,
            )
            return torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)

    registry.register_backend(Leaky.name, Leaky, replace=True)
    registry.refresh()
    yield Leaky.name
    registry.unregister_backend(Leaky.name)
    registry.refresh()


@pytest.mark.parametrize(
    ("prop", "words"),
    [
        ("extras_together", "NaN/+Inf/-Inf hidden states at the"),
        ("kl_accuracy", "NaN/+Inf/-Inf hidden states of both heads at the ignored rows"),
    ],
)
def test_nan_and_inf_at_ignored_rows_must_reach_no_extra_output(leaky, prop, words):
    result = check_property(prop, leaky)
    assert result.outcome is Outcome.FAIL, result.line()
    assert words in result.message


@pytest.mark.parametrize("prop", ["extras_together", "kl_accuracy"])
@pytest.mark.parametrize("backend", ["outputs-ref", "torch"])
def test_a_backend_that_selects_ignored_rows_out_passes(output_backends, backend, prop):
    result = check_property(prop, backend)
    assert result.outcome is Outcome.PASS, result.line()
