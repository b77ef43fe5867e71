"""A saturated softcap's gradients match float64 element by element, on torch and triton.

Where ``x / c`` is large, ``tanh`` rounds to within an ulp of 1 and ``1 - tanh^2`` formed from it
keeps no relative precision: gradients through the cap were off by 2-4x the kit's elementwise
fp32 bound (a few e-7 relative to the whole gradient; 2 % of a V = 1 head's). The backends form the
derivative from ``x`` itself (``sech^2``), so these hold at the kit's fp32 tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch

import fusedhead
from fusedhead.testing.inputs import make_case
from fusedhead.testing.outputs import _check_kl, check_outputs
from fusedhead.testing.target import Target

#: (output, N, H, V, input scale, temperature, softcap, seed): cases a random search found outside
#: the bound on the torch backend before (``scripts/gpu/fuzz_outputs.py --device cpu --dtype fp32``).
SATURATED = [
    ("sum_p2", 9, 15, 257, 4.0, 0.106, 0.5, 59970),
    ("topk", 3, 128, 129, 10.0, 0.776, 3.0, 3967),
]


def _target(backend: str) -> Target:
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the triton backend runs on the CPU under TRITON_INTERPRET=1 only")
    return Target.resolve(backend, None, "cpu", "fp32")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("output", "n", "h", "v", "scale", "t", "cap", "seed"), SATURATED)
def test_gradients_through_a_saturated_cap(backend, output, n, h, v, scale, t, cap, seed):
    target = _target(backend)
    case = make_case(n, h, v, scale=scale, seed=seed)
    label = f"{case.description}, {output}, scale {scale}, T {t}, softcap {cap}"
    check_outputs(target, case, (output,), label=label, temperature=t, softcap=cap, k=min(7, v))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_the_kl_student_gradients_through_a_saturated_cap(backend, direction):
    target = _target(backend)
    case = make_case(3, 15, 129, scale=4.0, seed=1)
    teacher = make_case(3, 9, 129, scale=4.0, seed=2)
    label = f"{direction} KL, {case.description}, student softcap 0.5, T_s 0.11"
    _check_kl(target, case, teacher, direction, 0.11, 1.1, label, (0.5, None))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logits_a_saturated_cap_makes_equal_go_to_the_lower_id(backend):
    """Past ``|x| ~ 9 c`` the capped logits ``c tanh(x / c)`` are equal in fp32: top-k and argmax
    rank them by the lower id, as any equal logits. torch ranked by the raw ``x`` and returned
    other ids (the log-probs were the same); it ranks ``tanh(x / c)`` now."""
    _target(backend)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 32, generator=g) * 20
    weight = torch.randn(300, 32, generator=g) / 5
    z = 0.5 * torch.tanh((hidden @ weight.T) / 0.5)
    ties = z == z.amax(dim=1, keepdim=True)
    assert int(ties.sum(dim=1).min()) > 4  # many ids share each row's max
    lowest = [row.nonzero().squeeze(1)[:4].tolist() for row in ties]
    out = fusedhead.fused_head(
        hidden, weight, torch.zeros(4, dtype=torch.long), backend=backend, softcap=0.5, top_k=4,
        return_argmax=True,
    )  # fmt: skip
    assert out.topk_ids.tolist() == lowest
    assert out.argmax.tolist() == [ids[0] for ids in lowest]
