"""The ``policy`` bench case: one PPO/GRPO step of the LM head, the loss's forward + backward.

Issue 31's H200 case: verl's loss with clip 0.2 / 0.28, entropy bonus 0.01, k3 KL 0.001 against a
reference policy, token-mean, at the case's temperature. Old and reference log-probs are the
current ones plus N(0, 0.1^2) noise, advantages N(0, 1) per token, from a generator seeded by the
case. Three ways to compute it:

- a fusedhead backend by name (``triton``, ``torch``): ``FusedHead.policy_loss``, the gradients
  computed in the forward (three GEMMs per token chunk);
- ``unfused:NAME``: the backend's log-probs and entropy, then the same loss in torch
  (``reference.policy_loss_from_log_probs``), backward through both (four GEMMs);
- a peer that computes log-probs and entropy (``liger-direct``, ``verl-chunked``, ``reference``):
  its own call, then the same loss in torch.

Each is ``fn(h, w, y) -> (loss 0-d, None)``; the bench runs ``loss.backward()``. The reference is
``reference_policy_loss`` over row blocks in float64 on the CPU, fp32 (TF32 off) on a GPU: with
token-mean and the global token count as the normaliser, the blocks' losses and gradients add up
to the whole batch's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fusedhead.reference import (
    policy_loss_from_log_probs,
    reference_fused_head,
    reference_policy_loss,
)

NAME = "policy"
#: The loss's settings (issue 31's H200 case); the temperature is the case's.
LOSS: dict[str, Any] = {
    "clip_low": 0.2,
    "clip_high": 0.28,
    "entropy_coef": 0.01,
    "kl_coef": 0.001,
    "kl_estimator": "k3",
    "aggregation": "token-mean",
}
#: Standard deviation of the old and reference log-probs around the current ones.
NOISE = 0.1
IGNORE_INDEX = -100
Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, None]]
StatsFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]
]


@dataclass(frozen=True)
class Terms:
    """The per-token RL terms of one batch: fp32 ``[N]`` on the case's device."""

    old_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    advantages: torch.Tensor

    def kwargs(self) -> dict[str, Any]:
        return {
            "old_log_probs": self.old_log_probs,
            "ref_log_probs": self.ref_log_probs,
            "advantages": self.advantages,
            **LOSS,
        }


_TERMS: dict[tuple[Any, ...], Terms] = {}


def _block_rows(vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    budget = (1 << 30) if device.type == "cuda" else (128 << 20)
    return max(1, budget // (vocab * torch.empty((), dtype=dtype).element_size()))


def terms(case: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> Terms:
    """The batch's terms (computed once per process for each case and row count): the current
    log-probs in fp32 by row blocks, plus seeded noise."""
    key = (tuple(sorted(case.to_dict().items())), hidden.shape[0])
    if key in _TERMS:
        return _TERMS[key]
    device = hidden.device
    n = hidden.shape[0]
    lp = torch.empty(n, dtype=torch.float32, device=device)
    rows = _block_rows(case.vocab, torch.float32, device)
    with torch.no_grad():
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            part, _ = reference_fused_head(
                hidden[start:stop],
                weight,
                labels[start:stop],
                temperature=case.temperature,
                ignore_index=IGNORE_INDEX,
                return_entropy=False,
                compute_dtype=torch.float32,
            )
            lp[start:stop] = part
    gen = torch.Generator(device=device).manual_seed(case.seed + 31)
    noise = torch.randn(3, n, device=device, generator=gen)
    out = Terms(lp + NOISE * noise[0], lp + NOISE * noise[1], noise[2].contiguous())
    _TERMS[key] = out
    return out


def loss_from_stats(
    log_probs: torch.Tensor, entropy: torch.Tensor, labels: torch.Tensor, t: Terms
) -> torch.Tensor:
    """The same loss in torch from a head's fp32 log-probs and entropy (the four-GEMM paths)."""
    kw = t.kwargs()
    return policy_loss_from_log_probs(log_probs.float(), entropy.float(), labels, **kw)


def fused(case: Any, head: Any) -> Fn:
    """``FusedHead.policy_loss`` of a backend that declares ``policy_loss``."""

    def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, None]:
        t = terms(case, h.detach(), w.detach(), y)
        out = head.policy_loss(
            h, w, y, temperature=case.temperature, ignore_index=IGNORE_INDEX, **t.kwargs()
        )
        return out.loss, None

    return fn


def unfused(case: Any, stats: StatsFn) -> Fn:
    """``stats(h, w, y) -> (log_probs, entropy)``, then the loss in torch."""

    def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, None]:
        t = terms(case, h.detach(), w.detach(), y)
        lp, ent = stats(h, w, y)
        if ent is None:
            raise ValueError("the policy loss's entropy bonus needs the entropy; got None")
        return loss_from_stats(lp, ent, y, t), None

    return fn


@dataclass
class Reference:
    """The batch's loss and its gradients in ``dtype``."""

    dtype: torch.dtype
    loss: torch.Tensor
    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor


def compute_reference(case: Any, inputs: Any, dtype: torch.dtype | None = None) -> Reference:
    """``reference_policy_loss`` over row blocks (token-mean over the whole batch's count)."""
    from fusedhead.bench.metrics import reference_dtype

    device = inputs.hidden.device
    dtype = dtype or reference_dtype(device)
    t = terms(case, inputs.hidden, inputs.weight, inputs.labels)
    count = float((inputs.labels != IGNORE_INDEX).sum())
    w = inputs.weight.detach().to(dtype).requires_grad_(True)
    dh = torch.empty(inputs.hidden.shape, dtype=dtype, device=device)
    dw = torch.zeros_like(w)
    loss = torch.zeros((), dtype=dtype, device=device)
    rows = _block_rows(case.vocab, dtype, device)
    kw = {k: v for k, v in t.kwargs().items() if k not in ("aggregation",)}
    for start in range(0, case.n, rows):
        stop = min(case.n, start + rows)
        h = inputs.hidden[start:stop].detach().to(dtype).requires_grad_(True)
        rows_kw: dict[str, Any] = {
            k: v[start:stop].to(dtype) if isinstance(v, torch.Tensor) else v for k, v in kw.items()
        }
        part = reference_policy_loss(
            h,
            w,
            inputs.labels[start:stop],
            **rows_kw,
            temperature=case.temperature,
            aggregation="token-mean",
            loss_normalizer=max(count, 1.0),
            ignore_index=IGNORE_INDEX,
            compute_dtype=dtype,
        )
        gh, gw = torch.autograd.grad([part], [h, w])
        dh[start:stop] = gh
        dw += gw
        loss += part.detach()
    return Reference(dtype, loss, dh, dw)


def compare(
    ref: Reference,
    loss: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> dict[str, Any]:
    """Errors of the loss (abs and relative) and of both gradients (relative L2, max abs)."""
    from fusedhead.bench.metrics import error

    got, want = float(loss.detach()), float(ref.loss)
    diff = abs(got - want)
    rel = diff / abs(want) if want else (0.0 if diff == 0 else math.inf)
    return {
        "loss": {"rel": rel, "max_abs": diff, "value": got, "reference": want},
        "log_probs": None,
        "entropy": None,
        "grad_hidden": None if grad_hidden is None else error(grad_hidden, ref.grad_hidden),
        "grad_weight": None if grad_weight is None else error(grad_weight, ref.grad_weight),
    }
