"""Errors name what the caller passed, not what the library built from it: ``FusedLMHead`` with a
bias folds it into one more column of the weight (``H + 1``), so a wrong hidden or bias was
reported in the folded shapes ("weight's H=17, got hidden shape (6, 16)" for a hidden of 15) or
as torch's ``cat`` error; ``fusedhead demo --model NAME`` with an unknown name said "needs
transformers" when transformers was missing, instead of naming the valid models.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from fusedhead import FusedLMHead, fused_head
from fusedhead.cli import main


def _head() -> FusedLMHead:
    return FusedLMHead.from_linear(nn.Linear(16, 40, bias=True), {"backend": "torch"})


def test_a_wrong_hidden_size_with_a_bias_names_the_callers_shapes():
    with pytest.raises(ValueError) as info:
        _head()(torch.randn(6, 15), torch.randint(0, 40, (6,)))
    assert str(info.value) == (
        "hidden's last dimension must equal weight's H=16, got hidden shape (6, 15) "
        "(weight is [V, H]: shape (40, 16))"
    )


def test_a_transposed_weight_is_named_as_such():
    """Before: the width error alone, with neither the weight's shape nor its layout."""
    h, w = torch.randn(2, 6, 16), torch.randn(40, 16)
    with pytest.raises(ValueError) as info:
        fused_head(h, w.T, torch.randint(0, 40, (2, 6)))
    assert str(info.value) == (
        "hidden's last dimension must equal weight's H=40, got hidden shape (2, 6, 16) "
        "(weight is [V, H]: shape (16, 40)); weight looks transposed: pass the LM head's "
        "weight as [V, H] (lm_head.weight, not its .T)"
    )


@pytest.mark.parametrize(
    ("bias", "error", "message"),
    [
        (torch.randn(39), ValueError, "bias must have shape [V]=(40,) to match weight (40, 16), got (39,)"),
        (torch.randn(40, 1), ValueError, "bias must have shape [V]=(40,) to match weight (40, 16), got (40, 1)"),
        (torch.ones(40, dtype=torch.long), TypeError, "bias must be a floating-point tensor, got dtype torch.int64"),
    ],
    ids=["short", "2-d", "integer"],
)  # fmt: skip
def test_a_bias_replaced_after_construction_is_named(bias, error, message):
    head = _head()
    head.bias = nn.Parameter(bias, requires_grad=bias.is_floating_point())
    with pytest.raises(error) as info:
        head(torch.randn(6, 16), torch.randint(0, 40, (6,)))
    assert str(info.value) == message


def test_the_bias_path_still_matches_the_linear_layer():
    lin = nn.Linear(16, 40, bias=True)
    head = FusedLMHead.from_linear(lin, {"backend": "torch"})
    h, y = torch.randn(6, 16), torch.randint(0, 40, (6,))
    want = torch.log_softmax(lin(h).double(), -1).gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(head(h, y).log_probs.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("transformers_installed", [True, False])
def test_demo_with_an_unknown_model_names_the_models(monkeypatch, capsys, transformers_installed):
    if not transformers_installed:
        monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    code = main(["demo", "--model", "nope"])
    err = capsys.readouterr().err
    assert code == 2
    assert (
        "unknown demo model 'nope'; choose one of ['tiny-gemma2', 'tiny-llama', 'tiny-qwen2']"
        in err
    )
    assert "needs transformers" not in err
