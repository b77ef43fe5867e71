"""A confident token's log-prob and gradient are as exact as fp32 allows, on torch and triton.

Where the label holds nearly all the mass (p from 0.995 to 1 - 1e-10, logits about 40 / T), its
log-prob is near 0 and its gradient carries ``1 - p``. The triton backend formed both from
``lse = m + log s`` in fp32, which rounds ``log s`` to an ulp of ``m``: the log-prob was off by
1.7e-6 (about its own size) and the gradients by 3e-3 to 5e-3 relative (fused_head, and
fused_policy_loss at T = 0.7; 5.6e-4 at T = 1), 15 to 45 times fp32 autograd's error. The log-prob
is now ``(z_y - m) - log s`` and the backward's label column reads it, as the torch backend's
log-prob always did. The bound is 4x fp32 autograd's error on the same batch: the fused paths
form the label column's ``g (1 - p)`` from two rounded terms, as autograd's ``onehot - p`` does,
with a rounding or two more (0.04x to 3.2x across these cases, on the CPU).
"""

from __future__ import annotations

import math

import pytest
import torch

import fusedhead
from fusedhead.reference import reference_policy_loss

N, H, V, T = 32, 32, 300, 0.7


def _confident_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's largest logit (about 40) is its label's: p(label) from 0.995 to 1 - 1e-10."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g) / math.sqrt(H)
    labels = torch.randint(0, V, (N,), generator=g)
    w_y = weight[labels]
    hidden = w_y * 40 / w_y.norm(dim=1, keepdim=True) ** 2 + 0.3 * torch.randn(N, H, generator=g)
    return hidden, weight, labels, torch.randn(N, generator=g)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _head_grads(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, upstream: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Autograd from full logits in ``dtype``: log-probs, gradients of ``sum(upstream * lp)``."""
    h = hidden.to(dtype, copy=True).requires_grad_()
    w = weight.to(dtype, copy=True).requires_grad_()
    lp = torch.log_softmax(h @ w.T / T, dim=-1).gather(1, labels[:, None]).squeeze(1)
    (lp * upstream.to(dtype)).sum().backward()
    assert h.grad is not None and w.grad is not None
    return lp.detach(), h.grad, w.grad


def _policy_grads(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, kw: dict[str, torch.Tensor],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``reference_policy_loss`` in ``dtype`` and its gradients."""
    h = hidden.to(dtype, copy=True).requires_grad_()
    w = weight.to(dtype, copy=True).requires_grad_()
    loss = reference_policy_loss(h, w, labels, **kw, temperature=T, compute_dtype=dtype)
    loss.backward()
    assert h.grad is not None and w.grad is not None
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("extras", [False, True], ids=["log_probs", "with_lse"])
def test_a_confident_tokens_log_prob_and_gradients_keep_fp32_precision(backend, extras):
    """Within 4x of fp32 autograd's error (1.1e-4 / 8.4e-5 here); triton was 5.0e-3 / 3.1e-3."""
    hidden, weight, labels, upstream = _confident_batch()
    want_lp, want_dh, want_dw = _head_grads(hidden, weight, labels, upstream, torch.float64)
    assert float(want_lp.min()) > -6e-3  # confident: 1 - p is small
    _, fp32_dh, fp32_dw = _head_grads(hidden, weight, labels, upstream, torch.float32)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = fusedhead.fused_head(
        h,
        w,
        labels,
        backend=backend,
        temperature=T,
        return_lse=extras,  # lse: the extras' path
    )
    (out.log_probs * upstream).sum().backward()
    assert h.grad is not None and w.grad is not None
    assert float((out.log_probs.double() - want_lp).abs().max()) < 2e-7  # triton was 1.7e-6
    assert _rel(h.grad, want_dh) < 4 * _rel(fp32_dh, want_dh)
    assert _rel(w.grad, want_dw) < 4 * _rel(fp32_dw, want_dw)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_confident_tokens_policy_loss_gradients_keep_fp32_precision(backend):
    """Within 4x of fp32 autograd's error (1.1e-4 / 8.4e-5 here); triton was 5.1e-3 / 3.2e-3."""
    hidden, weight, labels, advantages = _confident_batch()
    kw = {"old_log_probs": torch.full((N,), -1e-3), "advantages": advantages}
    want, want_dh, want_dw = _policy_grads(hidden, weight, labels, kw, torch.float64)
    _, fp32_dh, fp32_dw = _policy_grads(hidden, weight, labels, kw, torch.float32)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = fusedhead.fused_policy_loss(h, w, labels, backend=backend, temperature=T, **kw)
    out.loss.backward()
    assert h.grad is not None and w.grad is not None
    assert abs(float(out.loss) - float(want)) <= 1e-5 * abs(float(want))
    assert _rel(h.grad, want_dh) < 4 * _rel(fp32_dh, want_dh)
    assert _rel(w.grad, want_dw) < 4 * _rel(fp32_dw, want_dw)


def _kl_grads(
    student: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor, teacher_weight: torch.Tensor,
    temps: tuple[float, float], direction: str, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-row KL from full log-softmaxes in ``dtype``, and the gradients of its sum."""
    h = student.to(dtype, copy=True).requires_grad_()
    w = weight.to(dtype, copy=True).requires_grad_()
    log_q = torch.log_softmax(h @ w.T / temps[0], dim=-1)
    log_p = torch.log_softmax(teacher.to(dtype) @ teacher_weight.to(dtype).T / temps[1], dim=-1)
    a, b = (log_p, log_q) if direction == "forward" else (log_q, log_p)
    kl = (a.exp() * (a - b)).sum(-1)
    kl.sum().backward()
    assert h.grad is not None and w.grad is not None
    return kl.detach(), h.grad, w.grad


def _check_kl(
    backend: str, direction: str, student: torch.Tensor, weight: torch.Tensor,
    teacher: torch.Tensor, teacher_weight: torch.Tensor, temps: tuple[float, float],
) -> torch.Tensor:  # fmt: skip
    """``fused_kl``'s value and student gradients within 4x fp32 autograd's error against
    float64; returns the float64 KL (for the case's own precondition)."""
    args = (student, weight, teacher, teacher_weight, temps, direction)
    want, want_dh, want_dw = _kl_grads(*args, torch.float64)
    fp32, fp32_dh, fp32_dw = _kl_grads(*args, torch.float32)
    h = student.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    kl = fusedhead.fused_kl(
        h, w, teacher, teacher_weight, backend=backend, direction=direction,
        temperature=temps[0], teacher_temperature=temps[1],
    )  # fmt: skip
    kl.sum().backward()
    assert h.grad is not None and w.grad is not None
    assert _rel(kl.detach(), want) < 4 * _rel(fp32, want)
    assert _rel(h.grad, want_dh) < 4 * _rel(fp32_dh, want_dh)
    assert _rel(w.grad, want_dw) < 4 * _rel(fp32_dw, want_dw)
    return want


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_the_kl_of_two_confident_heads_keeps_fp32_precision(backend, direction):
    """A student close to a confident teacher: a KL of about 2e-7 from logits of about 40 / T.
    Both backends formed ``lse = m + log s`` in fp32, rounded to an ulp of the max (3.8e-6):
    torch's KL value ``cross - (lse_t - lse_s)`` was 10x to 30x fp32's error, triton's gradient
    ``p_s - p_t`` 40x to 80x. Neither forms an lse now: the KL is the cross term of the offsets
    ``z - m`` with ``log(s_t / s_s)``, and triton's backward reads each head's max and ``log s``."""
    teacher, weight, _, _ = _confident_batch()
    student = teacher + 0.3 * torch.randn(N, H, generator=torch.Generator().manual_seed(1))
    want = _check_kl(backend, direction, student, weight, teacher, weight, (T, T))
    assert 1e-8 < float(want.mean()) < 1e-5  # a small KL: the case that cancels


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize(("t_student", "t_teacher"), [(0.05, 1.0), (1.0, 0.05)])
def test_the_kl_of_heads_at_different_temperatures_keeps_fp32_precision(
    backend, direction, t_student, t_teacher
):
    """One head's logits in the hundreds (T = 0.05), the other's a few: a KL of a few nats.
    Both backends formed the cross term from the raw logits, ``z_s - z_t`` rounded to an ulp of
    ``z`` (1.5e-5 at 160), which the maxima then cancelled: the KL value 16x and the reverse
    gradient 9x fp32 autograd's error. The cross term is now of the offsets ``z - m``."""
    g = torch.Generator().manual_seed(0)
    hs, ht = torch.randn(N, H, generator=g), torch.randn(N, H, generator=g)
    ws = torch.randn(V, H, generator=g) * (4 if t_student < 1 else 1) / math.sqrt(H)
    wt = torch.randn(V, H, generator=g) * (4 if t_teacher < 1 else 1) / math.sqrt(H)
    want = _check_kl(backend, direction, hs, ws, ht, wt, (t_student, t_teacher))
    assert float(want.mean()) > 0.1  # a KL of nats: the raw logits' rounding is what cancels


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("output", ["entropy", "gathered", "topk_log_probs", "sum_p2"])
def test_the_extras_gradients_of_confident_rows_keep_fp32_precision(backend, output):
    """A row sure of one id (T = 0.3, margin 6); the loss reads an output other than the label's
    log-prob. triton's backward read every column's log p as ``z - lse``, an ulp of the row max
    off, and a confident column's ``1 - p`` carried it: 5x to 10x fp32 autograd's error. It reads
    ``(z - max) - log s`` now (the forward hands the backward each row's max and log s)."""
    t, n, v = 0.3, 16, 100
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(v, H, generator=g) / math.sqrt(H)
    top = torch.randint(0, v, (n,), generator=g)
    hidden = torch.randn(n, H, generator=g) * 0.1 + 6.0 * weight[top] / (weight[top] ** 2).sum(
        -1, keepdim=True
    )
    upstream = torch.randn(n, 1, generator=g, dtype=torch.float64)

    def reference(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        h = hidden.to(dtype, copy=True).requires_grad_()
        w = weight.to(dtype, copy=True).requires_grad_()
        lp = torch.log_softmax(h @ w.T / t, dim=-1)
        value = {
            "entropy": -(lp.exp() * lp).sum(-1),
            "gathered": lp.gather(1, top[:, None]),
            "topk_log_probs": lp.gather(1, top[:, None]),
            "sum_p2": lp.exp().square().sum(-1),
        }[output]
        (value.reshape(n, 1).double() * upstream).sum().backward()
        assert h.grad is not None and w.grad is not None
        return h.grad, w.grad

    want_dh, want_dw = reference(torch.float64)
    fp32_dh, fp32_dw = reference(torch.float32)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = fusedhead.fused_head(
        h, w, top, backend=backend, temperature=t, gather_ids=top[:, None], top_k=1,
        return_sum_p2=True,
    )  # fmt: skip
    (getattr(out, output).reshape(n, 1).double() * upstream).sum().backward()
    assert h.grad is not None and w.grad is not None
    assert _rel(h.grad, want_dh) < 4 * _rel(fp32_dh, want_dh)
    assert _rel(w.grad, want_dw) < 4 * _rel(fp32_dw, want_dw)
