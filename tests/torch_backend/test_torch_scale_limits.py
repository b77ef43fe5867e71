"""The torch backend's scale limits, as a caller meets them through the core. ``c / T`` with a
softcap was held at 2^100: a cap of 1e34 (the identity in fp32) gave a near-uniform softmax
(-3.0 where the reference is -6.1), in ``fused_head`` and ``fused_kl``. It is folded only up to
2^126 now, ``c`` applied to ``tanh(x / c)`` past it. (``1 / T`` alone stays held at 2^100, a
documented limit: below T = 7.9e-31 a temperature acts as 7.9e-31.)"""

from __future__ import annotations

import pytest
import torch

from fusedhead import fused_head, fused_kl

N, H, V = 5, 8, 40


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    return h, w, torch.randint(0, V, (N,), generator=g)


def _log_softmax(h: torch.Tensor, w: torch.Tensor, cap: float, t: float) -> torch.Tensor:
    z = h @ w.T
    return torch.log_softmax(cap * torch.tanh(z / cap) / t, dim=-1)


@pytest.mark.parametrize("per_token", [False, True], ids=["float-T", "per-token-T"])
@pytest.mark.parametrize(
    ("cap", "t"), [(1e34, 1.0), (1e34, 1e-4), (2.0**126, 0.7), (30.0, 1e-3), (2.5, 1e-25)]
)
def test_a_softcap_at_any_size_gives_the_reference(cap: float, t: float, per_token: bool) -> None:
    h64, w64, y = _inputs()
    ref_h = h64.clone().requires_grad_()
    ref = _log_softmax(ref_h, w64, cap, t)
    ref_lp = ref.gather(1, y.unsqueeze(1)).squeeze(1)
    ref_lp.sum().backward()
    h = h64.float().requires_grad_()
    temp = torch.full((N,), t) if per_token else t
    out = fused_head(h, w64.float(), y, backend="torch", softcap=cap, temperature=temp)
    scale = ref_lp.abs().max()
    assert float((out.log_probs.double() - ref_lp).abs().max() / scale) <= 1e-6
    out.log_probs.sum().backward()
    assert h.grad is not None and ref_h.grad is not None
    err = (h.grad.double() - ref_h.grad).norm() / ref_h.grad.norm().clamp_min(1e-300)
    assert float(err) <= 1e-5


def test_the_kl_under_a_huge_softcap_is_the_uncapped_kl() -> None:
    h64, w64, _ = _inputs()
    g = torch.Generator().manual_seed(1)
    th, tw = torch.randn(N, 4, generator=g), torch.randn(V, 4, generator=g)
    got = fused_kl(h64.float(), w64.float(), th, tw, backend="torch", softcap=1e34)
    ls = torch.log_softmax(h64 @ w64.T, -1)
    lt = torch.log_softmax(th.double() @ tw.double().T, -1)
    want = (lt.exp() * (lt - ls)).sum(-1)  # forward KL(teacher || student)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
