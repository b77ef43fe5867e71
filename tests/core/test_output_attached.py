"""The core's output check catches an output cut from the graph whatever its ``requires_grad``
says (writing-a-backend.md: outputs are checked to be attached), for (log_probs, entropy), each
extra output and the KL; a correct output passes, on the first call and on the fast path after.

Before: ``torch.zeros(n, requires_grad=True)`` or ``.detach().requires_grad_()`` passed the check
(it read ``requires_grad`` only) and left ``hidden.grad`` None without a word.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fusedhead import fused_head, fused_kl
from fusedhead.errors import BackendContractError
from fusedhead.protocol import Capabilities, HeadCall, HeadOutput, KLCall, KLOutput

N = 6


def _good(call: Any) -> torch.Tensor:
    """A differentiable [N] output computed from hidden and weight."""
    return torch.logsumexp(call.hidden.float() @ call.weight.float().T, -1)


#: How a faulty backend makes an output, and what the error must say.
FAULTS: dict[str, tuple[Callable[[Any], torch.Tensor], str]] = {
    "a new leaf marked requires_grad": (
        lambda call: torch.zeros(call.hidden.shape[0], requires_grad=True),
        r"not attached to hidden or weight \(requires_grad is True but grad_fn is None",
    ),
    "detach().requires_grad_()": (
        lambda call: _good(call).detach().requires_grad_(),
        r"not attached to hidden or weight \(requires_grad is True but grad_fn is None",
    ),
    "computed from an unrelated leaf": (
        lambda call: torch.zeros(call.hidden.shape[0], requires_grad=True) * 1,
        r"autograd graph does not reach hidden or weight, which require grad",
    ),
    "hidden detached inside": (
        lambda call: torch.logsumexp(call.hidden.detach().float() @ call.weight.float().T, -1),
        r"autograd graph does not reach hidden, which requires grad",
    ),
}


def _backend(variant: Any, fault: Callable[[Any], torch.Tensor] | None, field: str) -> None:
    def forward(self: Any, call: HeadCall) -> HeadOutput:
        out = {"log_probs": _good(call), "entropy": _good(call)}
        if "lse" in call.outputs:
            out["lse"] = _good(call)
        if fault is not None:
            out[field] = fault(call)
        return HeadOutput(**out)

    def kl(self: Any, call: KLCall) -> KLOutput:
        return KLOutput(_good(call) if fault is None else fault(call))

    variant(
        "attached-test",
        capabilities=lambda self, device: Capabilities(
            devices=("cpu",), outputs=("log_probs", "entropy", "lse"), kl_directions=("forward",)
        ),
        forward=forward,
        kl=kl,
    )


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, requires_grad=True)
    return hidden, weight, torch.randint(0, 11, (N,), generator=g)


def _call(field: str) -> Any:
    h, w, y = _inputs()
    if field == "kl":
        return fused_kl(h, w, h.detach(), w.detach(), y, backend="attached-test")
    return fused_head(h, w, y, backend="attached-test", return_lse=field == "lse")


@pytest.mark.parametrize("field", ["log_probs", "entropy", "lse", "kl"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_output_cut_from_the_graph_is_a_contract_error(variant, fault, field):
    make, message = FAULTS[fault]
    _backend(variant, make, field)
    with pytest.raises(BackendContractError, match=message) as info:
        _call(field)
    assert str(info.value).startswith(
        f"backend 'attached-test': broke the plugin contract: {field}"
    )


@pytest.mark.parametrize("field", ["log_probs", "lse", "kl"])
def test_attached_outputs_pass_on_the_first_call_and_after(variant, field):
    _backend(variant, None, field)
    for _ in range(3):  # the first call walks the graph, later ones take the fast path
        out = _call(field)
        t = out if field == "kl" else getattr(out, field)
        assert t.grad_fn is not None


def test_a_fast_path_call_still_refuses_a_leaf_output(variant):
    """After a good first call, a later call whose output has no graph is still refused."""
    state = {"bad": False}

    def make(call: Any) -> torch.Tensor:
        good = _good(call)
        return good.detach().requires_grad_() if state["bad"] else good

    _backend(variant, make, "log_probs")
    _call("log_probs")
    state["bad"] = True
    with pytest.raises(BackendContractError, match="grad_fn is None"):
        _call("log_probs")


def test_no_grad_and_inputs_without_grad_are_not_checked_for_a_graph(variant):
    _backend(variant, FAULTS["a new leaf marked requires_grad"][0], "log_probs")
    h, w, y = _inputs()
    with torch.no_grad():
        fused_head(h, w, y, backend="attached-test")
    fused_head(h.detach(), w.detach(), y, backend="attached-test")
