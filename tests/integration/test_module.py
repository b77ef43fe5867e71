"""FusedLMHead: the contract's numbers through an nn.Module that shares the LM head's Parameter."""

from __future__ import annotations

import copy

import pytest
import torch
from integration_helpers import BACKEND, assert_close64, full_logits_reference
from torch import nn

from fusedhead import FusedHeadConfig, FusedLMHead
from fusedhead.api import FusedHeadOutput

H, V, N = 24, 37, 10


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, N // 2, H, generator=g)
    labels = torch.randint(0, V, (2, N // 2), generator=g)
    labels[0, 1] = -100
    return hidden, labels


def _linear(bias: bool, seed: int = 1) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(4.0)
        if bias:
            lin.bias.normal_(0, 1)
    return lin


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(
    ("temperature", "softcap"),
    [(1.0, None), (0.7, None), ("per-token", None), (0.7, 3.0), ("per-token", 3.0)],
)
def test_outputs_and_grads_match_full_logits(
    bias: bool, temperature: object, softcap: float | None
) -> None:
    lin = _linear(bias)
    head = FusedLMHead.from_linear(lin, {"backend": BACKEND, "softcap": softcap})
    hidden, labels = _inputs()
    if temperature == "per-token":
        temperature = torch.rand(labels.shape, generator=torch.Generator().manual_seed(3)) + 0.5
    h = hidden.clone().requires_grad_(True)
    out = head(h, labels, temperature=temperature)
    assert isinstance(out, FusedHeadOutput)
    assert out.log_probs.shape == labels.shape and out.log_probs.dtype == torch.float32

    h64 = hidden.double().requires_grad_(True)
    w64 = lin.weight.detach().double().requires_grad_(True)
    b64 = lin.bias.detach().double().requires_grad_(True) if bias else None
    lp, ent = full_logits_reference(
        h64, w64, labels, bias=b64, temperature=temperature, softcap=softcap
    )
    assert_close64(out.log_probs, lp)
    assert_close64(out.entropy, ent)

    g = torch.Generator().manual_seed(5)
    g_lp, g_ent = torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g)
    ((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
    ((lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    assert_close64(h.grad, h64.grad)
    assert_close64(lin.weight.grad, w64.grad)  # the head's Parameter is the Linear's
    if bias:
        assert_close64(lin.bias.grad, b64.grad)
    assert torch.all(h.grad[0, 1] == 0), "an ignored row must get no gradient"


def test_shares_the_linear_parameters_and_state_dict_keys() -> None:
    lin = _linear(bias=True)
    head = FusedLMHead.from_linear(lin, FusedHeadConfig(backend=BACKEND))
    assert head.weight is lin.weight and head.bias is lin.bias
    assert set(head.state_dict()) == set(lin.state_dict()) == {"weight", "bias"}
    assert [p for p in head.parameters()] == [lin.weight, lin.bias]
    assert "backend='torch'" in repr(head)


def test_without_labels_it_is_the_linear() -> None:
    lin = _linear(bias=True)
    head = FusedLMHead.from_linear(lin, {"backend": BACKEND})
    hidden, _ = _inputs()
    torch.testing.assert_close(head(hidden), lin(hidden), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("args", "kwargs", "shown"),
    [
        ((None, 0.7), {}, "temperature=0.7"),
        ((), {"top_k": 5}, "top_k=5"),
        ((), {"return_lse": True}, "return_lse=True"),
        ((), {"reduce_hidden_grad": False}, "reduce_hidden_grad=False"),
        ((), {"ignore_index": -1, "softcap": 30.0}, "ignore_index=-1, softcap=30.0"),
        ((), {"vocab_start": 0, "vocab_size": 64}, "vocab_start=0, vocab_size=64"),
    ],
    ids=["temperature", "top_k", "return_lse", "reduce_hidden_grad", "two", "shard"],
)
def test_without_labels_a_fused_calls_argument_is_refused_not_dropped(
    args: tuple[object, ...], kwargs: dict[str, object], shown: str
) -> None:
    """Before: the raw logits came back and the argument was ignored without a word."""
    head = FusedLMHead.from_linear(_linear(bias=True), {"backend": BACKEND})
    hidden, _ = _inputs()
    with pytest.raises(TypeError, match=rf"without labels returns the logits.* got {shown}; pass"):
        head(hidden, *args, **kwargs)


def test_config_defaults_and_per_call_overrides() -> None:
    lin = _linear(bias=False)
    head = FusedLMHead.from_linear(
        lin, {"backend": BACKEND, "temperature": 0.5, "return_entropy": False}
    )
    hidden, labels = _inputs()
    out = head(hidden, labels)
    assert out.entropy is None
    lp, _ = full_logits_reference(hidden, lin.weight.detach(), labels, temperature=0.5)
    assert_close64(out.log_probs, lp)
    out = head(hidden, labels, temperature=2.0, return_entropy=True)
    lp, ent = full_logits_reference(hidden, lin.weight.detach(), labels, temperature=2.0)
    assert_close64(out.log_probs, lp)
    assert_close64(out.entropy, ent)


def test_softcap_applies_before_temperature() -> None:
    """z = c * tanh(h @ W.T / c), then / T (Gemma-2's final_logit_softcapping, then sampling temperature)."""
    lin = _linear(bias=False)
    c, t = 2.0, 0.5
    head = FusedLMHead.from_linear(lin, {"backend": BACKEND, "softcap": c})
    hidden, labels = _inputs()
    out = head(hidden, labels, temperature=t)
    z = hidden.double() @ lin.weight.detach().double().T
    right = torch.log_softmax(c * torch.tanh(z / c) / t, -1)
    wrong = torch.log_softmax(c * torch.tanh(z / t / c), -1)
    valid = labels != -100
    want = right.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    other = wrong.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    assert_close64(out.log_probs[valid], want[valid])
    assert (out.log_probs[valid].double() - other[valid]).abs().max() > 1e-2


class _TiedLM(nn.Module):
    """Embedding and LM head sharing one Parameter, as in GPT-2 and Gemma."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.head = FusedLMHead(self.embed.weight, {"backend": BACKEND})

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> FusedHeadOutput:
        return self.head(torch.tanh(self.body(self.embed(ids))), labels)


def test_tied_embeddings_gradient_reaches_the_shared_parameter_from_both_uses() -> None:
    model = _TiedLM()
    assert model.head.weight is model.embed.weight
    assert len(list(model.parameters())) == 3  # embed/head weight once, body weight and bias
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (2, 6), generator=g)
    labels = torch.randint(0, V, (2, 6), generator=g)
    out = model(ids, labels)
    (out.log_probs.sum() + out.entropy.sum()).backward()

    w = model.embed.weight.detach().double().requires_grad_(True)
    body_w = model.body.weight.detach().double()
    body_b = model.body.bias.detach().double()
    hidden = torch.tanh(w[ids] @ body_w.T + body_b)
    lp, ent = full_logits_reference(hidden, w, labels)
    assert_close64(out.log_probs, lp)
    (lp.sum() + ent.sum()).backward()
    assert_close64(model.embed.weight.grad, w.grad)
    # Both uses contribute: the head part alone differs from the total.
    w_head = model.embed.weight.detach().double().requires_grad_(True)
    lp2, ent2 = full_logits_reference(hidden.detach(), w_head, labels)
    (lp2.sum() + ent2.sum()).backward()
    assert (w_head.grad - w.grad).abs().max() > 1e-3


def test_from_model_finds_the_head_and_reads_softcap_from_the_model_config() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = _linear(bias=False)
            self.config = type("Cfg", (), {"final_logit_softcapping": 3.0})()

    model = Model()
    head = FusedLMHead.from_model(model, {"backend": BACKEND})
    assert head.weight is model.lm_head.weight
    assert head.config.softcap == 3.0
    hidden, labels = _inputs()
    lp, _ = full_logits_reference(hidden, model.lm_head.weight.detach(), labels, softcap=3.0)
    assert_close64(head(hidden, labels).log_probs, lp)
    explicit = FusedLMHead.from_model(model, {"backend": BACKEND, "softcap": 7.0})
    assert explicit.config.softcap == 7.0


def test_from_model_via_get_output_embeddings() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = _linear(bias=False)

        def get_output_embeddings(self) -> nn.Module:
            return self.out

    model = Model()
    assert FusedLMHead.from_model(model, {"backend": BACKEND}).weight is model.out.weight


def test_refusals_say_what_to_do() -> None:
    lin = _linear(bias=False)
    with pytest.raises(TypeError, match=r"nn\.Parameter"):
        FusedLMHead(lin.weight.detach(), {"backend": BACKEND})
    with pytest.raises(ValueError, match=r"bias must have shape \[V\]"):
        FusedLMHead(lin.weight, {"backend": BACKEND}, bias=nn.Parameter(torch.zeros(3)))
    with pytest.raises(TypeError, match=r"nn\.Linear"):
        FusedLMHead.from_linear(nn.Embedding(3, 4), {"backend": BACKEND})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be"):
        FusedLMHead(lin.weight, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="neither an lm_head"):
        FusedLMHead.from_model(nn.Sequential(), {"backend": BACKEND})


def test_unknown_backend_fails_at_construction() -> None:
    from fusedhead.errors import BackendError

    with pytest.raises(BackendError, match="unknown fusedhead backend"):
        FusedLMHead(_linear(bias=False).weight, {"backend": "no-such-backend"})


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_distillation_outputs_come_through_the_module_as_through_the_call(bias: bool) -> None:
    """top_k, gather_ids and the extras reach the head; values are the full logits' (bias too)."""
    hidden, labels = _inputs(4)
    lin = _linear(bias, seed=5)
    head = FusedLMHead.from_linear(lin, FusedHeadConfig(backend=BACKEND))
    ids = torch.randint(0, V, (2, N // 2, 6), generator=torch.Generator().manual_seed(6))
    out = head(hidden, labels, 0.7, top_k=4, gather_ids=ids, return_lse=True,
               return_sum_p2=True, return_argmax=True)  # fmt: skip
    z = (copy.deepcopy(lin).double()(hidden.double()) / 0.7).detach()
    logp = torch.log_softmax(z, -1)
    valid = labels != -100
    assert out.topk_ids is not None and out.topk_log_probs is not None and out.gathered is not None
    assert torch.equal(out.topk_ids[valid], logp.topk(4, -1).indices[valid])
    assert_close64(out.topk_log_probs[valid], logp.topk(4, -1).values[valid])
    assert_close64(out.gathered[valid], logp.gather(-1, ids)[valid])
    assert out.lse is not None and out.sum_p2 is not None and out.argmax is not None
    assert_close64(out.lse[valid], torch.logsumexp(z, -1)[valid])
    assert_close64(out.sum_p2[valid], (logp.exp() ** 2).sum(-1)[valid])
    assert torch.equal(out.argmax[valid], z.argmax(-1)[valid])
    for t in (out.lse, out.topk_log_probs, out.gathered):  # FSDP2 hooks need non-view outputs
        assert not t._is_view()


def test_fsdp2_is_recognised_where_its_class_is_still_private(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.4-2.5 (the core's floor) export ``FSDPModule`` only from
    ``torch.distributed._composable.fsdp``: a sharded head must still be recognised there, or it
    would read its weight outside FSDP2's forward (a shard, not the full rows)."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed._composable.fsdp import FSDPModule

    from fusedhead.module import is_fsdp_module

    class Sharded(FSDPModule, torch.nn.Linear):
        pass

    sharded = torch.nn.Linear(2, 3)
    sharded.__class__ = Sharded  # what fully_shard does to a module's class
    monkeypatch.delattr(fsdp, "FSDPModule")  # the public name, as before torch 2.6
    with pytest.raises(ImportError):
        from torch.distributed.fsdp import FSDPModule as _  # noqa: F401
    assert is_fsdp_module(sharded)
    assert not is_fsdp_module(torch.nn.Linear(2, 3))
