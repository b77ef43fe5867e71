"""A backend's ``min_temperature``: the triton backend declares the smallest temperature it
computes to its precision, and the core refuses a smaller one by name (a float at once, per-token
values in the call's checked read), for the head and for either head of the KL. Below it the
backward's fused ``z / T - lse`` lost the gradient (non-finite on an H200 from T = 1e-10 with
logits of about 5, and under the interpreter from T = 1e-20)."""

from __future__ import annotations

import pytest
import torch

from fusedhead import FusedHead, fused_head, fused_kl, fused_policy_loss
from fusedhead.errors import CapabilityError
from fusedhead_triton.backend import MIN_TEMPERATURE, TritonBackend

N, H, V = 5, 16, 40


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / 4).requires_grad_()
    return hidden, weight, torch.randint(0, V, (N,), generator=g)


def _refused(info: pytest.ExceptionInfo[CapabilityError], arg: str) -> None:
    text = str(info.value)
    assert info.value.capability == "min_temperature", text
    assert info.value.backend == "triton", text
    assert f"min_temperature={MIN_TEMPERATURE:g}" in text and arg in text, text


def test_triton_declares_its_floor_and_torch_the_cores() -> None:
    assert TritonBackend().capabilities(torch.device("cpu")).min_temperature == MIN_TEMPERATURE
    assert MIN_TEMPERATURE > 2.0**-126
    h, w, y = _inputs()
    out = fused_head(h, w, y, backend="torch", temperature=1e-30)  # torch: down to 2**-126
    assert torch.isfinite(out.log_probs).all()


@pytest.mark.parametrize("temperature", [MIN_TEMPERATURE / 2, 1e-20, 2.0**-126])
def test_a_float_temperature_below_the_floor_is_refused_by_name(temperature: float) -> None:
    h, w, y = _inputs()
    with pytest.raises(CapabilityError) as info:
        fused_head(h, w, y, backend="triton", temperature=temperature)
    _refused(info, f"temperature={temperature!r}")
    with pytest.raises(CapabilityError) as info:
        FusedHead(backend="triton", temperature=temperature)(h, w, y)
    _refused(info, "temperature")
    with pytest.raises(CapabilityError) as info:  # a plain call and one with outputs alike
        fused_head(h, w, y, backend="triton", temperature=temperature, top_k=2)
    _refused(info, "temperature")


def test_the_floor_itself_is_computed() -> None:
    h, w, y = _inputs()
    out = fused_head(h, w, y, backend="triton", temperature=MIN_TEMPERATURE)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_a_per_token_temperature_below_the_floor_is_refused_in_the_checked_read() -> None:
    h, w, y = _inputs()
    temps = torch.full((N,), 0.7)
    temps[3] = 1e-6
    with pytest.raises(CapabilityError) as info:
        fused_head(h, w, y, backend="triton", temperature=temps)
    _refused(info, "a per-token temperature of 1e-06")  # the smallest value, as fp32
    # check_labels=False skips every value read (CUDA-graph capture): the call runs unchecked
    out = fused_head(h, w, y, backend="triton", temperature=temps.clone(), check_labels=False)
    assert out.log_probs.shape == (N,)


@pytest.mark.parametrize("per_token", [False, True])
def test_the_policy_loss_below_the_floor_is_refused_as_the_head_is(per_token: bool) -> None:
    """fused_policy_loss gated a per-token tensor without the checked read: a value under the
    floor ran (a float was refused)."""
    h, w, y = _inputs()
    low: float | torch.Tensor = 1e-6
    if per_token:
        low = torch.full((N,), 0.7)
        low[3] = 1e-6
    loss = dict(old_log_probs=None, advantages=torch.ones(N), temperature=low)
    with pytest.raises(CapabilityError) as info:
        fused_policy_loss(h, w, y, backend="triton", **loss)  # type: ignore[arg-type]
    _refused(info, "temperature")
    with pytest.raises(CapabilityError) as info:
        FusedHead(backend="triton").policy_loss(h, w, y, **loss)  # type: ignore[arg-type]
    _refused(info, "temperature")
    assert h.grad is None and w.grad is None  # refused before the backend ran
    out = fused_policy_loss(h, w, y, backend="torch", **loss)  # type: ignore[arg-type]
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("arg", ["temperature", "teacher_temperature"])
@pytest.mark.parametrize("per_token", [False, True])
def test_either_head_of_the_kl_below_the_floor_is_refused(arg: str, per_token: bool) -> None:
    h, w, y = _inputs()
    low: float | torch.Tensor = 1e-5
    if per_token:
        low = torch.full((N,), 1.0)
        low[0] = 1e-5
    kwargs = {arg: low}
    with pytest.raises(CapabilityError) as info:
        fused_kl(h, w, h.detach() * 0.9, w.detach(), y, backend="triton", **kwargs)  # type: ignore[arg-type]
    _refused(info, arg)
    with pytest.raises(CapabilityError) as info:
        FusedHead(backend="triton").kl(h, w, h.detach() * 0.9, w.detach(), y, **kwargs)  # type: ignore[arg-type]
    _refused(info, arg)
    # the torch backend takes it
    kl = fused_kl(h, w, h.detach() * 0.9, w.detach(), y, backend="torch", **kwargs)  # type: ignore[arg-type]
    assert torch.isfinite(kl).all()


@pytest.mark.parametrize("kl", [False, True])
def test_a_traced_per_token_temperature_below_the_floor_is_refused_by_the_graph(kl: bool) -> None:
    """Under torch.compile(fullgraph=True) the check is an op of the graph (no graph break), as
    the core's other value checks: the same CapabilityError; a good tensor gives eager's bits."""
    torch._dynamo.reset()
    h, w, y = _inputs()
    teacher = h.detach() * 0.9

    def step(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if kl:
            return fused_kl(h, w, teacher, w.detach(), y, backend="triton", teacher_temperature=t)
        return fused_head(h, w, y, backend="triton", temperature=t).log_probs

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    low = torch.full((N,), 0.7)
    low[2] = 1e-5
    with pytest.raises(CapabilityError) as info:
        compiled(h, w, low)
    _refused(info, "teacher_temperature" if kl else "a per-token temperature of 1e-05")
    good = torch.full((N,), 0.7)
    assert torch.equal(compiled(h, w, good), step(h, w, good))
