"""The torch backend's scale limits, as a caller meets them through the core. ``c / T`` with a
softcap was held at 2^100: a cap of 1e34 (the identity in fp32) gave a near-uniform softmax
(-3.0 where the reference is -6.1), in ``fused_head`` and ``fused_kl``. It is folded only up to
2^126 now, ``c`` applied to ``tanh(x / c)`` past it. ``1 / T`` alone is held at 2^100, so the
backend declares ``min_temperature`` 2^-100 and the core refuses a smaller temperature by name;
below it the log-probs saturated at -2^100 times the logit gap, silently (an error of 0.87 and
more against float64 at T <= 1e-31).)"""

from __future__ import annotations

import pytest
import torch

from fusedhead import fused_head, fused_kl, fused_policy_loss
from fusedhead.errors import CapabilityError

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


@pytest.mark.parametrize("per_token", [False, True], ids=["float-T", "per-token-T"])
def test_the_floor_temperature_gives_the_reference_and_below_it_is_refused(
    per_token: bool,
) -> None:
    h64, w64, y = _inputs()
    floor = 2.0**-100

    def temp(t: float) -> float | torch.Tensor:
        return torch.full((N,), t) if per_token else t

    ref = torch.log_softmax((h64 @ w64.T) / floor, dim=-1).gather(1, y.unsqueeze(1)).squeeze(1)
    out = fused_head(h64.float(), w64.float(), y, backend="torch", temperature=temp(floor))
    assert float(((out.log_probs.double() - ref).abs() / ref.abs().clamp_min(1.0)).max()) <= 1e-5
    for call in (
        lambda t: fused_head(h64.float(), w64.float(), y, backend="torch", temperature=t),
        lambda t: fused_policy_loss(
            h64.float(),
            w64.float(),
            y,
            old_log_probs=None,
            advantages=torch.ones(N),
            backend="torch",
            temperature=t,
        ),
    ):
        with pytest.raises(CapabilityError) as info:
            call(temp(floor / 2))
        assert info.value.capability == "min_temperature"
        assert "min_temperature=7.88861e-31" in str(info.value), info.value
