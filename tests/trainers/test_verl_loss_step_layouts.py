"""verl's fused loss step on the micro-batch layout of verl 0.9.1's default (v1) trainer.

That trainer stacks each sample's fields with ``list_of_dict_to_tensordict``: prompts,
responses, the response mask and the per-token fields arrive as jagged nested tensors, where
the legacy trainer's ``left_right_2_no_padding`` hands them padded. The step read the response
mask's width from the nested tensor and failed (``'NestedIntNode' object has no attribute
'guard_int'``) at the first step; it must give verl's own ``ppo_loss`` and its gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("verl", reason="verl is not installed (bash scripts/trainers/verl.sh)")

from verl.trainer.ppo import core_algos
from verl.utils import tensordict_utils as tu
from verl.workers.config.actor import ActorConfig, PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

from fusedhead.integrations import verl_actor
from fusedhead.integrations.backend_spec import resolve_lm_head

V, H, T = 50, 16, 0.8
#: (prompt, response) lengths; the first response has a masked token, the third is all masked
SEQS = [(3, 5), (2, 6), (4, 3), (2, 4)]


def _micro_batch() -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(v1 micro-batch, hidden [1, T, H] fp64, weight fp64, next-token ids [1, T], offsets)."""
    g = torch.Generator().manual_seed(0)
    samples, ids = [], []
    for i, (p, r) in enumerate(SEQS):
        prompt, response = (
            torch.randint(0, V, (p,), generator=g),
            torch.randint(0, V, (r,), generator=g),
        )
        mask = torch.ones(r, dtype=torch.long)
        if i == 0:
            mask[2] = 0
        if i == 2:
            mask[:] = 0
        ids.append(torch.cat([prompt, response]))
        samples.append({
            "prompts": prompt, "responses": response, "response_mask": mask, "input_ids": ids[-1],
            "old_log_probs": -3.0 + 0.5 * torch.randn(r, generator=g),
            "ref_log_prob": -3.0 + 0.5 * torch.randn(r, generator=g),
            "advantages": torch.full((r,), float(torch.randn((), generator=g))),
        })  # fmt: skip
    data = tu.list_of_dict_to_tensordict(samples)
    tu.assign_non_tensor(
        data, calculate_entropy=True, dp_size=1, batch_num_tokens=None, global_batch_size=None
    )
    total = sum(p + r for p, r in SEQS)
    hidden = torch.randn(1, total, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / 2
    rolled = torch.roll(torch.cat(ids), -1)[None]
    offsets = torch.tensor([0, *[p + r for p, r in SEQS]]).cumsum(0)
    return data, hidden, weight, rolled, offsets


def _config(mode: str) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, entropy_coeff=0.01,
        use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
        policy_loss=PolicyLossConfig(loss_mode=mode),
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_v1_trainers_nested_micro_batch_gives_verls_loss_and_gradients(backend: str) -> None:
    verl_actor.register_loss_mode(core_algos)
    data, hidden, weight, rolled, offsets = _micro_batch()
    assert data["response_mask"].is_nested and data["prompts"].is_nested

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = h[0] @ w.T / T
    lp = torch.log_softmax(logits, -1).gather(-1, rolled[0][:, None])[:, 0]
    ent = torch.special.entr(torch.softmax(logits, -1)).sum(-1)
    nest = torch.nested.nested_tensor_from_jagged
    want, want_metrics = ppo_loss(
        _config("vanilla"), {"log_probs": nest(lp, offsets), "entropy": nest(ent, offsets)}, data
    )
    want.backward()

    fh, lm = hidden.float().requires_grad_(), nn.Linear(H, V, bias=False)
    lm.weight = nn.Parameter(weight.float())
    pending = verl_actor._Pending(
        hidden=fh, lm_head=lm, head=resolve_lm_head(backend), labels=rolled, temperature=T
    )
    got, metrics = verl_actor.fused_ppo_loss_step(_config("fusedhead"), {}, data, pending=pending)
    got.backward()

    assert set(metrics) == set(want_metrics)
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)), (float(got), float(want))
    for name, a, b in (("hidden", fh.grad, h.grad), ("weight", lm.weight.grad, w.grad)):
        assert a is not None and b is not None
        err = float((a.double() - b).norm() / b.norm())
        assert err < 1e-5, f"grad {name}: relative error {err:.2e}"
