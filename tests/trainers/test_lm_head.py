"""``lm_head_logprobs``: already-shifted labels scored from a trainer's own LM-head module.

Every result is checked against full float64 logits of the same float32 values: packed and padded
hidden states, ignored rows (0 and zero gradient), bias, per-token temperature, softcap; the rows
that reach the backend; the weight read inside the module's call (ZeRO-3 style hooks, FSDP2); the
backend spellings and the errors for bad input.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fusedhead
from fusedhead import FusedHead, FusedHeadConfig, FusedLMHead
from fusedhead.errors import UnknownBackendError
from fusedhead.hooks import hookimpl, register_hooks, unregister_hooks
from fusedhead.integrations import is_fusedhead_spec, lm_head_logprobs, parse_backend_spec
from fusedhead.request import HeadRequest

IGNORE = -100
H, V = 24, 97
ATOL = 2e-5  # float32 inputs against float64 logits of the same values


@pytest.fixture(autouse=True)
def _fresh_heads() -> Iterator[None]:
    fusedhead.refresh()
    yield
    fusedhead.refresh()


def _linear(bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 2 / math.sqrt(H))
        if bias:
            assert lin.bias is not None
            lin.bias.normal_(0, 0.5)
    return lin


def _inputs(shape: tuple[int, ...], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g).requires_grad_(True)
    labels = torch.randint(0, V, shape, generator=g)
    flat = labels.view(-1)
    flat[::5] = IGNORE
    flat[-1] = IGNORE
    return hidden, labels


def _reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full float64 logits: log-prob of each label and entropy, 0 where ignored."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    logp = torch.log_softmax(z / t, dim=-1)
    valid = labels != IGNORE
    lp = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def _loss(lp: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    w1 = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    w2 = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    assert ent is not None
    return (lp.double() * w1).sum() + (ent.double() * w2).sum()


def _grads(*tensors: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for t in tensors:
        assert t.grad is not None
        out.append(t.grad.detach().clone())
        t.grad = None
    return out


@pytest.mark.parametrize("shape", [(1, 23), (3, 9)], ids=["packed", "padded"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_full_logits_with_gradients(shape: tuple[int, ...], bias: bool) -> None:
    lin = _linear(bias)
    hidden, labels = _inputs(shape)
    out = lm_head_logprobs(lin, hidden, labels, head="torch")
    assert out.log_probs.shape == labels.shape and out.log_probs.dtype == torch.float32
    assert out.entropy is not None and out.entropy.shape == labels.shape
    _loss(out.log_probs, out.entropy).backward()
    params = [hidden, lin.weight] + ([lin.bias] if lin.bias is not None else [])
    got = _grads(*params)

    ref_lp, ref_ent = _reference(hidden, lin.weight, lin.bias, labels)
    _loss(ref_lp, ref_ent).backward()
    want = _grads(*params)
    torch.testing.assert_close(out.log_probs.double(), ref_lp, rtol=0, atol=ATOL)
    torch.testing.assert_close(out.entropy.double(), ref_ent, rtol=0, atol=ATOL)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-4, atol=ATOL)
    ignored = labels == IGNORE
    assert ignored.any()
    assert torch.all(out.log_probs[ignored] == 0) and torch.all(out.entropy[ignored] == 0)
    assert torch.all(got[0][ignored] == 0), "ignored rows must get exactly zero hidden gradient"
    assert got[0][~ignored].abs().sum() > 0


class _Spy(FusedHead):
    """A head that records the shapes and labels of every call it gets."""

    seen: list[tuple[tuple[int, ...], torch.Tensor]]

    def run(self, req: HeadRequest) -> Any:
        self.seen.append((tuple(req.hidden.shape), req.labels.clone()))
        return super().run(req)


def test_only_scored_rows_reach_the_backend() -> None:
    head = _Spy({"backend": "torch"})
    seen: list[tuple[tuple[int, ...], torch.Tensor]] = []
    head.seen = seen
    hidden, labels = _inputs((3, 9))
    lm_head_logprobs(_linear(), hidden, labels, head=head)
    n_valid = int((labels != IGNORE).sum())
    assert [s for s, _ in seen] == [(n_valid, H)]
    assert torch.equal(seen[0][1], labels[labels != IGNORE])

    seen.clear()
    out = lm_head_logprobs(_linear(), hidden, labels, head=head, select_rows=False)
    assert [s for s, _ in seen] == [(labels.numel(), H)]
    ref = lm_head_logprobs(_linear(), hidden, labels, head=head)
    torch.testing.assert_close(out.log_probs, ref.log_probs, rtol=0, atol=1e-6)


def test_select_rows_false_matches_and_is_sync_free_shape() -> None:
    lin = _linear(bias=True)
    hidden, labels = _inputs((2, 11))
    a = lm_head_logprobs(lin, hidden, labels, select_rows=True)
    b = lm_head_logprobs(lin, hidden, labels, select_rows=False)
    torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=1e-6)
    assert a.entropy is not None and b.entropy is not None
    torch.testing.assert_close(a.entropy, b.entropy, rtol=0, atol=1e-6)
    assert torch.all(b.log_probs[labels == IGNORE] == 0)


def test_select_rows_false_traces_whole_under_torch_compile() -> None:
    """The sync-free path is one graph (``fullgraph=True``) and gives eager's values and gradients:
    the DTensor check and the outputs' copy trace."""
    lin = _linear(bias=True)
    hidden, labels = _inputs((2, 11))

    def step(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = lm_head_logprobs(lin, h, labels, select_rows=False)
        assert out.entropy is not None
        return out.log_probs, out.entropy

    h_eager = hidden.detach().clone().requires_grad_()
    h_comp = hidden.detach().clone().requires_grad_()
    lp_e, ent_e = step(h_eager)
    _loss(lp_e, ent_e).backward()
    grads_e = _grads(h_eager, lin.weight, lin.bias)
    lp_c, ent_c = torch.compile(step, fullgraph=True, backend="aot_eager")(h_comp)
    _loss(lp_c, ent_c).backward()
    grads_c = _grads(h_comp, lin.weight, lin.bias)
    torch.testing.assert_close(lp_c, lp_e, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent_c, ent_e, rtol=0, atol=1e-6)
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["per_token", "per_sample"])
def test_per_token_temperature(form: str) -> None:
    lin = _linear()
    hidden, labels = _inputs((3, 8))
    g = torch.Generator().manual_seed(3)
    if form == "per_token":
        temp = 0.5 + torch.rand(labels.shape, generator=g)
        temp[labels == IGNORE] = 0.0  # never used: ignored rows may hold anything
        full = temp.clone()
    else:
        temp = 0.5 + torch.rand((3, 1), generator=g)
        full = temp.expand(labels.shape)
    out = lm_head_logprobs(lin, hidden, labels, temperature=temp)
    ref_lp, ref_ent = _reference(hidden, lin.weight, None, labels, torch.where(full > 0, full, 1.0))
    torch.testing.assert_close(out.log_probs.double(), ref_lp, rtol=0, atol=ATOL)
    assert out.entropy is not None
    torch.testing.assert_close(out.entropy.double(), ref_ent, rtol=0, atol=ATOL)
    # A float temperature is not the per-token one: the check above can tell them apart.
    plain = lm_head_logprobs(lin, hidden, labels, temperature=1.0)
    assert (plain.log_probs - out.log_probs).abs().max() > 1e-3


def test_softcap_and_float_temperature() -> None:
    lin = _linear()
    hidden, labels = _inputs((2, 7))
    out = lm_head_logprobs(lin, hidden, labels, temperature=0.7, softcap=3.0)
    ref_lp, ref_ent = _reference(hidden, lin.weight, None, labels, 0.7, softcap=3.0)
    torch.testing.assert_close(out.log_probs.double(), ref_lp, rtol=0, atol=ATOL)
    assert out.entropy is not None
    torch.testing.assert_close(out.entropy.double(), ref_ent, rtol=0, atol=ATOL)


def test_logit_scale_with_bias_and_softcap() -> None:
    lin = _linear(bias=True)
    hidden, labels = _inputs((2, 7))
    out = lm_head_logprobs(lin, hidden, labels, logit_scale=0.25, softcap=2.0, temperature=0.9)
    assert lin.bias is not None
    ref_lp, ref_ent = _reference(
        hidden * 0.25, lin.weight, lin.bias * 0.25, labels, 0.9, softcap=2.0
    )
    torch.testing.assert_close(out.log_probs.double(), ref_lp, rtol=0, atol=ATOL)
    assert out.entropy is not None
    torch.testing.assert_close(out.entropy.double(), ref_ent, rtol=0, atol=ATOL)


def test_compute_dtype_casts_inside_the_call() -> None:
    lin = _linear(bias=True).to(torch.bfloat16)
    hidden, labels = _inputs((2, 7))
    with pytest.raises(TypeError, match="share a dtype"):
        lm_head_logprobs(lin, hidden, labels)  # float32 hidden, bfloat16 head
    with torch.autocast("cpu", dtype=torch.bfloat16):  # compute_dtype wins over autocast
        out = lm_head_logprobs(lin, hidden, labels, compute_dtype=torch.float32)
    ref_lp, _ = _reference(hidden, lin.weight.float(), lin.bias.float(), labels)
    torch.testing.assert_close(out.log_probs.double(), ref_lp, rtol=0, atol=ATOL)
    _loss(out.log_probs, out.entropy).backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.bfloat16


def test_no_entropy_and_all_rows_ignored() -> None:
    lin = _linear()
    hidden, labels = _inputs((2, 5))
    out = lm_head_logprobs(lin, hidden, labels, return_entropy=False)
    assert out.entropy is None
    labels = torch.full_like(labels, IGNORE)
    out = lm_head_logprobs(lin, hidden, labels)
    assert torch.all(out.log_probs == 0) and out.entropy is not None
    assert torch.all(out.entropy == 0)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert hidden.grad is not None and torch.all(hidden.grad == 0)


@pytest.mark.parametrize("select_rows", [True, False], ids=["selected", "all-rows"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gather_ids_give_differentiable_log_probs_at_those_ids(
    select_rows: bool, bias: bool
) -> None:
    """A teacher's top-k ids: ``out.gathered [..., K]`` equals float64 logits' log-softmax at
    them (temperature and softcap applied), 0 on ignored rows, gradients those of float64."""
    lin = _linear(bias=bias)
    hidden, labels = _inputs((3, 7))
    ids = torch.randint(0, V, (3, 7, 4), generator=torch.Generator().manual_seed(3))
    t, cap = 0.7, 6.0
    out = lm_head_logprobs(
        lin, hidden, labels, temperature=t, softcap=cap, gather_ids=ids, select_rows=select_rows
    )
    assert out.gathered is not None and out.gathered.shape == (3, 7, 4)
    assert out.gathered.dtype == torch.float32
    w = torch.randn(3, 7, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (out.gathered.double() * w).sum().backward()
    got = _grads(hidden, lin.weight)

    z = hidden.double() @ lin.weight.double().T
    if bias:
        assert lin.bias is not None
        z = z + lin.bias.double()
    logp = torch.log_softmax(cap * torch.tanh(z / cap) / t, -1)
    want = torch.where((labels != IGNORE).unsqueeze(-1), logp.gather(-1, ids), 0.0)
    torch.testing.assert_close(out.gathered.double(), want.detach(), rtol=0, atol=ATOL)
    assert bool((out.gathered[labels == IGNORE] == 0).all())
    (want * w).sum().backward()
    for a, b in zip(got, _grads(hidden, lin.weight), strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=ATOL)
    # The label's own id gathers its log-prob.
    same = lm_head_logprobs(lin, hidden, labels, gather_ids=labels.clamp_min(0).unsqueeze(-1))
    assert same.gathered is not None
    torch.testing.assert_close(same.gathered[..., 0], same.log_probs, rtol=0, atol=0)


@pytest.mark.parametrize("select_rows", [True, False], ids=["selected", "all-rows"])
def test_sum_p2_and_argmax(select_rows: bool) -> None:
    """``out.sum_p2`` and ``out.argmax`` of the tempered distribution, 0 / -1 on ignored rows."""
    lin = _linear()
    hidden, labels = _inputs((3, 7))
    out = lm_head_logprobs(
        lin,
        hidden,
        labels,
        temperature=0.7,
        return_sum_p2=True,
        return_argmax=True,
        select_rows=select_rows,
    )
    assert out.sum_p2 is not None and out.argmax is not None
    assert out.sum_p2.shape == out.argmax.shape == (3, 7) and out.argmax.dtype == torch.int64
    logp = torch.log_softmax(hidden.detach().double() @ lin.weight.detach().double().T / 0.7, -1)
    scored = labels != IGNORE
    want = torch.where(scored, logp.exp().pow(2).sum(-1), 0.0)
    torch.testing.assert_close(out.sum_p2.double(), want, rtol=0, atol=ATOL)
    assert torch.equal(out.argmax, torch.where(scored, logp.argmax(-1), -1))


def test_gather_ids_must_extend_the_labels_shape() -> None:
    lin = _linear()
    hidden, labels = _inputs((2, 5))
    with pytest.raises(ValueError, match=r"gather_ids must have shape \[\*labels.shape, K\]"):
        lm_head_logprobs(lin, hidden, labels, gather_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match=r"gather_ids must be a torch\.Tensor"):
        lm_head_logprobs(lin, hidden, labels, gather_ids=[[1]])  # type: ignore[arg-type]


def test_other_ignore_index() -> None:
    lin = _linear()
    hidden, labels = _inputs((2, 6))
    shifted = torch.where(labels == IGNORE, -1, labels)
    a = lm_head_logprobs(lin, hidden, labels)
    b = lm_head_logprobs(lin, hidden, shifted, ignore_index=-1)
    torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=0)


def test_fused_lm_head_and_tied_embedding_modules() -> None:
    lin = _linear(bias=True)
    hidden, labels = _inputs((2, 6))
    want = lm_head_logprobs(lin, hidden, labels)
    fused = FusedLMHead.from_linear(lin, {"backend": "torch"})
    got = lm_head_logprobs(fused, hidden, labels)  # head=None: the FusedLMHead's own head
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=0)

    emb = nn.Embedding(V, H)
    with torch.no_grad():
        emb.weight.copy_(lin.weight)
    got = lm_head_logprobs(emb, hidden, labels)
    ref_lp, _ = _reference(hidden, lin.weight, None, labels)
    torch.testing.assert_close(got.log_probs.double(), ref_lp, rtol=0, atol=ATOL)


class _Zero3Like(nn.Module):
    """A head whose weight exists only inside its call, like DeepSpeed ZeRO-3's partitioned params."""

    def __init__(self, full: nn.Parameter) -> None:
        super().__init__()
        self.full = full
        self.weight: torch.Tensor = torch.empty(0)
        self.calls = 0
        self.register_forward_pre_hook(self._gather)
        self.register_forward_hook(self._release)

    @staticmethod
    def _gather(module: nn.Module, args: Any) -> None:
        assert isinstance(module, _Zero3Like)
        module.calls += 1
        module.weight = module.full.view_as(module.full)

    @staticmethod
    def _release(module: nn.Module, args: Any, output: Any) -> None:
        module.weight = torch.empty(0)


def test_weight_is_read_inside_the_module_call() -> None:
    lin = _linear()
    full = nn.Parameter(lin.weight.detach().clone())
    head = _Zero3Like(full)
    hidden, labels = _inputs((1, 17))
    out = lm_head_logprobs(head, hidden, labels)
    assert head.calls == 1 and head.weight.numel() == 0
    _loss(out.log_probs, out.entropy).backward()
    got = _grads(hidden, full)
    ref_lp, ref_ent = _reference(hidden, full, None, labels)
    _loss(ref_lp, ref_ent).backward()
    want = _grads(hidden, full)
    torch.testing.assert_close(out.log_probs.double(), ref_lp, rtol=0, atol=ATOL)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-4, atol=ATOL)


def test_in_call_false_reads_the_weight_directly() -> None:
    full = nn.Parameter(_linear().weight.detach().clone())
    head = _Zero3Like(full)
    hidden, labels = _inputs((1, 9))
    with pytest.raises(ValueError, match=r"\.weight must have shape \[V, H\]"):
        lm_head_logprobs(head, hidden, labels, in_call=False)  # outside the call: no weight
    assert head.calls == 0
    got: list[Any] = []
    # standing in for the head's forward during its own call, as the OpenRLHF patch does
    head.__dict__["forward"] = lambda h: got.append(
        lm_head_logprobs(head, h, labels, in_call=False)
    )
    head(hidden)
    del head.__dict__["forward"]
    assert head.calls == 1 and len(got) == 1
    ref_lp, _ = _reference(hidden, full, None, labels)
    torch.testing.assert_close(got[0].log_probs.double(), ref_lp, rtol=0, atol=ATOL)


def test_model_logit_transform() -> None:
    from types import SimpleNamespace as NS

    from fusedhead.integrations.lm_head import model_logit_transform

    assert model_logit_transform(NS()) == (1.0, None)
    assert model_logit_transform(NS(final_logit_softcapping=30.0)) == (1.0, 30.0)
    assert model_logit_transform(NS(logit_scale=0.0625)) == (0.0625, None)
    assert model_logit_transform(NS(logits_scaling=8.0, model_type="granite")) == (0.125, None)
    assert model_logit_transform(NS(logits_scaling=8.0, model_type="hyperclovax")) == (8.0, None)
    nested = NS(get_text_config=lambda: NS(lm_head_multiplier=2.0, final_logit_softcapping=None))
    assert model_logit_transform(nested) == (2.0, None)


def test_a_logit_transform_fusedhead_does_not_reproduce_is_read_or_refused() -> None:
    """RecurrentGemma caps its logits under another name (``logits_soft_cap``), and a model with
    ``unpadded_vocab_size`` drops its head's padded rows: both were dropped without a word, and a
    patched OpenRLHF actor's log-probs were 98.7 and 0.31 off."""
    from types import SimpleNamespace as NS

    from fusedhead.integrations.lm_head import model_logit_transform

    assert model_logit_transform(NS(logits_soft_cap=30.0)) == (1.0, 30.0)
    with pytest.raises(ValueError, match=r"^model.config.logits_soft_cap must be a finite number"):
        model_logit_transform(NS(logits_soft_cap=0.0))
    assert model_logit_transform(NS(unpadded_vocab_size=64, vocab_size=64)) == (1.0, None)
    padded = NS(unpadded_vocab_size=50, vocab_size=64, model_type="inkling")
    with pytest.raises(ValueError, match=r"^model.config.unpadded_vocab_size=50 \(inkling, vocab_"):
        model_logit_transform(padded)


@pytest.mark.parametrize(
    ("cap", "error", "words"),
    [
        ("30", TypeError, r"final_logit_softcapping must be a number > 0 or None, got str '30'"),
        (True, TypeError, r"final_logit_softcapping must be a number > 0 or None, got bool True"),
        (0.0, ValueError, r"final_logit_softcapping must be a finite number > 0 .* got 0.0"),
        (-5.0, ValueError, r"final_logit_softcapping must be a finite number > 0 .* got -5.0"),
        (float("inf"), ValueError, r"final_logit_softcapping must be a finite number > 0"),
    ],
    ids=["str", "bool", "zero", "negative", "inf"],
)
def test_a_models_softcap_is_read_by_its_name_or_refused(cap, error, words) -> None:
    """Before: "30" and True were taken as 30.0 and 1.0, 0 as no softcap (transformers divides by
    it: NaN logits), and -5.0 was refused as FusedHeadConfig's field, not the model's."""
    from types import SimpleNamespace as NS

    from fusedhead import FusedLMHead
    from fusedhead.integrations.lm_head import model_logit_transform

    with pytest.raises(error, match=words):
        model_logit_transform(NS(final_logit_softcapping=cap))
    model = nn.Module()
    model.config = NS(final_logit_softcapping=cap)
    model.lm_head = _linear()
    with pytest.raises(error, match=words):
        FusedLMHead.from_model(model, {"backend": "torch"})


def test_backend_spellings_resolve_the_same_backend() -> None:
    lin = _linear()
    hidden, labels = _inputs((2, 5))
    want = lm_head_logprobs(lin, hidden, labels, head=FusedHead({"backend": "torch"}))
    for head in (
        "torch",
        "fusedhead:torch",
        "fusedhead",
        {"backend": "torch"},
        FusedHeadConfig(backend="torch"),
        None,
    ):
        got = lm_head_logprobs(lin, hidden, labels, head=head)
        torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=0)
    assert parse_backend_spec("fusedhead:triton") == "triton"
    assert parse_backend_spec("fusedhead") == "torch"
    assert is_fusedhead_spec(" FusedHead:x") and not is_fusedhead_spec("triton")
    assert not is_fusedhead_spec(None)


@pytest.mark.parametrize(
    "spec", ["triton", "fusedhead:", "FusedHead:torch", "fusedhead-torch", "fusedhead:to rch"]
)
def test_parse_backend_spec_rejects_other_spellings(spec: str) -> None:
    with pytest.raises(ValueError, match="accepted forms") as info:
        parse_backend_spec(spec)
    assert repr(spec) in str(info.value) and "fusedhead:<backend name>" in str(info.value)


def test_unknown_backend_lists_what_is_installed() -> None:
    lin = _linear()
    hidden, labels = _inputs((1, 4))
    with pytest.raises(UnknownBackendError, match="no-such-backend") as info:
        lm_head_logprobs(lin, hidden, labels, head="fusedhead:no-such-backend")
    assert "torch" in str(info.value)
    with pytest.raises(ValueError, match="accepted forms"):
        lm_head_logprobs(lin, hidden, labels, head="fusedhead:")
    with pytest.raises(TypeError, match="backend spec must be a str"):
        parse_backend_spec(3)


def test_resolution_reports_provenance_once_per_config() -> None:
    seen: list[dict[str, Any]] = []

    class Recorder:
        @hookimpl
        def fusedhead_backend_resolved(
            self, name: str, distribution: str | None, version: str | None
        ) -> None:
            seen.append({"name": name, "distribution": distribution, "version": version})

    rec = Recorder()
    register_hooks(rec)
    try:
        lin = _linear()
        hidden, labels = _inputs((1, 6))
        lm_head_logprobs(lin, hidden, labels, head="fusedhead:torch")
        lm_head_logprobs(lin, hidden, labels, head="torch")  # same config: resolved once
        assert [s["name"] for s in seen] == ["torch"]
        assert seen[0]["distribution"] == "fusedhead-torch" and seen[0]["version"]
        lm_head_logprobs(lin, hidden, labels, head={"backend": "torch", "softcap": 2.0})
        assert len(seen) == 2
    finally:
        unregister_hooks(rec)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"labels": torch.zeros(2, 4, dtype=torch.long)}, ValueError, r"leading shape \(2, 5\)"),
        ({"labels": torch.zeros(2, 5)}, TypeError, "integer tensor"),
        ({"hidden": torch.randn(H)}, ValueError, "at least 2 dims"),
        ({"hidden": [[0.0]]}, TypeError, "hidden must be a torch.Tensor"),
        ({"temperature": torch.ones(3, 5)}, ValueError, r"temperature tensor of shape \(3, 5\)"),
        ({"temperature": "hot"}, TypeError, "temperature must be a float"),
        ({"temperature": torch.ones(2, 5, dtype=torch.long)}, TypeError, "floating point"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"ignore_index": -100.0}, TypeError, "ignore_index must be an int"),
        ({"lm_head": nn.ReLU()}, TypeError, "no .weight tensor"),
        ({"lm_head": "lm_head"}, TypeError, "lm_head must be an nn.Module"),
        ({"head": 3}, TypeError, "head must be a FusedHead"),
        ({"return_entropy": 1}, TypeError, "return_entropy must be a bool"),
        ({"logit_scale": 0.0}, ValueError, "logit_scale must be a finite non-zero"),
        ({"logit_scale": "1"}, TypeError, "logit_scale must be a float"),
        ({"compute_dtype": "float32"}, TypeError, "compute_dtype must be a torch.dtype"),
        ({"in_call": None}, TypeError, "in_call must be a bool"),
    ],
)
def test_bad_inputs(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    hidden, labels = _inputs((2, 5))
    args: dict[str, Any] = {"lm_head": _linear(), "hidden": hidden, "labels": labels, **kwargs}
    with pytest.raises(error, match=match):
        lm_head_logprobs(args.pop("lm_head"), args.pop("hidden"), args.pop("labels"), **args)


def test_wrong_weight_shape_inside_the_call() -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(V * H))

    hidden, labels = _inputs((1, 3))
    with pytest.raises(ValueError, match=r"\.weight must have shape \[V, H\]"):
        lm_head_logprobs(Flat(), hidden, labels)


_FSDP_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from fusedhead.integrations import lm_head_logprobs

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    torch.manual_seed(0)
    ref = nn.Linear(16, 41, bias=True)
    head = nn.Linear(16, 41, bias=True)
    head.load_state_dict(ref.state_dict())
    fully_shard(head)
    assert type(head.weight).__name__ == "DTensor"
    hidden = torch.randn(1, 13, 16, requires_grad=True)
    labels = torch.randint(0, 41, (1, 13))
    labels[0, ::4] = -100
    outs = []
    for module in (head, ref):
        h = hidden.detach().clone().requires_grad_(True)
        out = lm_head_logprobs(module, h, labels, head="fusedhead:torch")
        (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
        w = module.weight.grad
        w = w.full_tensor() if hasattr(w, "full_tensor") else w
        outs.append((out.log_probs.detach(), out.entropy.detach(), h.grad, w))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    dist.destroy_process_group()
    print("fsdp2-ok")
    """
)


@pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch built without torch.distributed"
)
def test_fsdp2_sharded_head_matches_unsharded(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", _FSDP_SCRIPT, str(tmp_path / "rendezvous")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0 and "fsdp2-ok" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero3_gathers_the_head_weight_for_the_fused_backward(tmp_path: Path) -> None:
    """Under DeepSpeed ZeRO-3 the head's weight is partitioned, gathered by the head's forward
    hooks and released after; the fused head reads it inside the head's call, and the hooks on
    that call's output gather it again for the backward: the log-probs, entropy and full
    gradients equal the model's own logits' (an untied and a tied Qwen2; the path of the TRL,
    verl and transformers glue)."""
    pytest.importorskip(
        "deepspeed", reason="DeepSpeed is not installed (scripts/trainers/openrlhf.sh)"
    )
    from spawned_ranks import run_ranks
    from zero3_workers import free_port, lm_head_worker, tiny_qwen2_dirs

    vocab = 53
    dirs = tiny_qwen2_dirs(tmp_path, vocab)
    run_ranks(lm_head_worker, (dirs, vocab, str(tmp_path), free_port()), 1, tmp_path, "ZeRO-3", 600)
    results = torch.load(tmp_path / "results.pt")
    for d in dirs:
        theirs, ours = results[d]["theirs"], results[d]["ours"]
        torch.testing.assert_close(ours["log_probs"], theirs["log_probs"], rtol=0, atol=1e-5)
        tied = "True" in d
        assert (
            set(ours["grads"])
            == set(theirs["grads"])
            == ({"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight"}))
        )
        for name, want in theirs["grads"].items():
            got = ours["grads"][name]
            assert float((got - want).norm() / want.norm()) < 1e-5, (d, name)
