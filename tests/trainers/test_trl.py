"""TRL: fusedhead behind TRL's ``add_fused_lm_head`` contract, the backend named by the config.

The acceptance run: ``GRPOTrainer`` for 2 offline steps on a tiny random Llama (reference model
on, beta > 0) with TRL's own kernel and with ``FusedHeadGRPOTrainer`` on the ``torch`` backend;
every fused call's log-probs and the logged loss, KL and entropy must agree. The drop-in is also
checked call by call against TRL's kernel and full float64 logits (gradients, softcap, logit
scale, ``shift_labels``, MoE auxiliary loss), and for its errors.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fusedhead

pytest.importorskip("trl", reason="TRL is not installed (bash scripts/trainers/trl.sh)")

import trl
from datasets import Dataset
from trl_helpers import (
    CPU_STEPS,
    WORDS,
    build_trainer,
    make_model_dir,
    make_tokenizer,
    reward_len,
    run_grpo,
)

from fusedhead.errors import UnknownBackendError
from fusedhead.hooks import hookimpl, register_hooks, unregister_hooks
from fusedhead.integrations import lm_head as lm_head_mod
from fusedhead.integrations import trl as fh_trl
from fusedhead.integrations.trl import FusedHeadTrainerMixin, FusedPolicyLossMixin

IGNORE = -100


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    fusedhead.refresh()
    yield
    fusedhead.refresh()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("trl-model"))


def test_grpo_two_steps_match_trls_own_kernel(model_dir: Path, tmp_path: Path) -> None:
    resolved: list[str] = []

    class Recorder:
        @hookimpl
        def fusedhead_backend_resolved(self, name: str) -> None:
            resolved.append(name)

    rec = Recorder()
    register_hooks(rec)
    try:
        theirs = run_grpo(model_dir, tmp_path / "trl", backend=None)
        ours = run_grpo(model_dir, tmp_path / "fusedhead", backend="fusedhead:torch")
    finally:
        unregister_hooks(rec)
    assert resolved == ["torch"], "the backend is resolved once, through the provenance hook"
    trainer = ours["trainer"]
    assert trainer.fused_head.name == "torch"
    for model in (trainer.model, trainer.ref_model):
        # our forward sits under the recorder the helper added; TRL's is no longer reached
        assert fh_trl.fused_head_of(model.forward.previous) is trainer.fused_head

    tags = [t for t, _ in theirs["calls"]]
    assert tags == [t for t, _ in ours["calls"]]
    assert tags.count("ref") == 2 and tags.count("policy") == 2, tags
    for (tag, a), (_, b) in zip(theirs["calls"], ours["calls"], strict=True):
        assert a.shape == b.shape
        err = float((a - b).abs().max())
        assert err <= 1e-6, f"{tag} call: log-probs differ by {err:.3g}"
        assert a.abs().max() > 0.5  # real log-probs, not zeros
    assert len(theirs["logs"]) == len(ours["logs"]) == 2
    for step, (a, b) in enumerate(zip(theirs["logs"], ours["logs"], strict=True), 1):
        for key in ("loss", "kl", "entropy"):  # 6 decimals, not rounding's straddled boundaries
            assert abs(a[key] - b[key]) <= 1e-6, (step, key, a[key], b[key])
    assert ours["logs"][1]["kl"] > 1e-4, "step 2 must see a policy that moved from the reference"


def test_rloo_two_steps_match_trls_own_kernel(model_dir: Path, tmp_path: Path) -> None:
    theirs = run_grpo(model_dir, tmp_path / "trl", backend=None, kind="RLOO")
    ours = run_grpo(model_dir, tmp_path / "fusedhead", backend="torch", kind="RLOO")
    assert ours["trainer"].fused_head.name == "torch"
    assert [t for t, _ in theirs["calls"]] == [t for t, _ in ours["calls"]]
    assert {t for t, _ in ours["calls"]} == {"policy", "ref"}
    for (tag, a), (_, b) in zip(theirs["calls"], ours["calls"], strict=True):
        err = float((a - b).abs().max())
        assert err <= 1e-6, f"{tag} call: log-probs differ by {err:.3g}"
    # RLOO's loss here cancels to ~0 (leave-one-out advantages sum to zero, ratio ~1): what is
    # logged is float32 rounding of ~1e-6 (TRL 1.6e-6, fusedhead 0.0 at step 2), compared as such.
    assert len(theirs["logs"]) == len(ours["logs"]) == 2
    for a, b in zip(theirs["logs"], ours["logs"], strict=True):
        for key in ("kl", "entropy"):
            assert abs(a[key] - b[key]) <= 1e-6, (key, a[key], b[key])
        assert abs(a["loss"] - b["loss"]) <= 2e-6, (a["loss"], b["loss"])


def test_mixin_finds_trls_head_behind_accelerates_bf16_wrapper(
    model_dir: Path, tmp_path: Path
) -> None:
    """With bf16 mixed precision accelerate wraps the reference model's forward in __init__;
    the mixin still finds TRL's head under it and puts fusedhead's on top."""
    trainer = build_trainer(model_dir, tmp_path, backend="torch", bf16=True)
    assert trainer.ref_model.forward.__func__ is not type(trainer.ref_model).forward
    for model in (trainer.model, trainer.ref_model):
        assert fh_trl.fused_head_of(model) is trainer.fused_head
    ids, mask, labels = _batch()
    with trainer.accelerator.autocast():
        out = trainer.ref_model(
            input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True
        )
    assert out.log_probs.dtype == torch.float32 and out.entropy is None  # ref: log-probs only


#: The config of a model whose forward scales its logits, then caps them (Muse Glimmer's
#: output_multiplier and final_logit_softcapping), on the tiny Llama: TRL's kernel and fusedhead
#: read the transform from the config, and the references below apply it by hand.
SOFTCAP_SCALE = {
    "model_type": "muse_glimmer",
    "output_multiplier": 0.5,
    "final_logit_softcapping": 4.0,
}


def _pair(model_dir: Path, **attrs: Any) -> tuple[Any, Any]:
    """Two copies of the tiny model: one with TRL's fused head, one with fusedhead's."""
    from transformers import AutoModelForCausalLM

    models = []
    for _ in range(2):
        m = AutoModelForCausalLM.from_pretrained(model_dir)
        for k, v in attrs.items():
            setattr(m.config, k, v)
        models.append(m)
    return models[0], models[1]


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 43, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[:, :3] = IGNORE  # a prompt
    return ids, mask, labels


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-300))


def _float64_grads(
    model_dir: Path,
    attrs: dict[str, Any],
    temperature: float,
    ids: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Gradients of the same loss (mean NLL + 0.3 * entropy sum) from float64 full logits."""
    model, _ = _pair(model_dir, **attrs)
    model = model.double()
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
    z = model.lm_head(hidden) * attrs.get("output_multiplier", 1.0)
    cap = attrs.get("final_logit_softcapping")
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    logp = torch.log_softmax(z / temperature, -1)
    y = labels[:, 1:]
    valid = y != IGNORE
    tok = logp.gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    loss = -(tok * valid).sum() / valid.sum() + 0.3 * (ent * valid).sum()
    loss.backward()
    return _grads(model)


@pytest.mark.parametrize(
    ("attrs", "temperature", "backend"),
    [
        ({}, 1.0, "torch"),
        ({}, 0.7, "torch"),
        (SOFTCAP_SCALE, 0.9, "torch"),
        (SOFTCAP_SCALE, 0.9, "triton"),
    ],
    ids=["plain", "temperature", "softcap-scale", "softcap-scale-triton"],
)
def test_drop_in_matches_trl_kernel_and_full_logits(
    model_dir: Path,
    attrs: dict[str, Any],
    temperature: float,
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``triton`` runs its kernels under the Triton interpreter on the CPU (fp32)."""
    from trl.trainer.utils import add_fused_lm_head as trl_add_fused_lm_head

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    theirs, ours = _pair(model_dir, **attrs)
    outputs = ("log_probs", "entropy")
    trl_add_fused_lm_head(theirs, temperature=temperature, outputs=outputs)
    fh_trl.add_fused_lm_head(ours, temperature=temperature, outputs=outputs, head=backend)
    ids, mask, labels = _batch()
    results = []
    for model in (theirs, ours):
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        (out.loss + 0.3 * out.entropy.sum()).backward()
        results.append((out, _grads(model)))
    (a, ga), (b, gb) = results
    assert type(a) is type(b) and b.log_probs.shape == (3, 9)
    # TRL's kernel multiplies by a rounded 1 / T: at T = 0.7 it is 2.2e-6 from float64 here, where
    # fusedhead equals full float32 logits (1.3e-6, checked below); at T = 1 the two agree to 1e-6.
    tol = 1e-6 if temperature == 1.0 else 4e-6
    torch.testing.assert_close(b.log_probs, a.log_probs, rtol=0, atol=tol)
    torch.testing.assert_close(b.entropy, a.entropy, rtol=0, atol=tol)
    torch.testing.assert_close(b.loss, a.loss, rtol=0, atol=1e-6)
    assert torch.equal(b.label_mask, a.label_mask)
    assert ga.keys() == gb.keys() and "lm_head.weight" in gb
    g64 = _float64_grads(model_dir, attrs, temperature, ids, mask, labels)
    for name in ga:  # fp32 rounding gives ~1e-7 relative; a wrong gradient gives far more
        assert _rel(gb[name], g64[name]) <= 1e-5, (name, _rel(gb[name], g64[name]))
        assert _rel(gb[name], ga[name]) <= 1e-5, (name, _rel(gb[name], ga[name]))

    # and both against float64 logits of the same hidden states
    with torch.no_grad():
        hidden = ours.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        z = hidden.double() @ ours.lm_head.weight.double().T * attrs.get("output_multiplier", 1.0)
        cap = attrs.get("final_logit_softcapping")
        if cap is not None:
            z = cap * torch.tanh(z / cap)
        logp = torch.log_softmax(z / temperature, -1)
        z32 = hidden @ ours.lm_head.weight.T * attrs.get("output_multiplier", 1.0)
        if cap is not None:
            z32 = cap * torch.tanh(z32 / cap)
        logp32 = torch.log_softmax(z32 / temperature, -1)  # what the model's own logits give
    y = labels[:, 1:]
    want32 = logp32.gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1).masked_fill(y == IGNORE, 0)
    torch.testing.assert_close(b.log_probs, want32, rtol=0, atol=1e-6)
    want = logp.gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1).masked_fill(y == IGNORE, 0)
    want_ent = (-(logp.exp() * logp).sum(-1)).masked_fill(y == IGNORE, 0)
    torch.testing.assert_close(b.log_probs.double(), want, rtol=0, atol=2e-6)
    torch.testing.assert_close(b.entropy.double(), want_ent, rtol=0, atol=2e-6)
    assert torch.all(b.log_probs[y == IGNORE] == 0)


@pytest.mark.parametrize(
    ("attrs", "temperature", "backend"),
    [
        ({}, 1.0, "torch"),
        ({}, 0.7, "torch"),
        (SOFTCAP_SCALE, 0.9, "torch"),
        ({}, 0.7, "triton"),
    ],
    ids=["plain", "temperature", "softcap-scale", "temperature-triton"],
)
def test_sft_and_dpo_statistics_match_trl_kernel(
    model_dir: Path,
    attrs: dict[str, Any],
    temperature: float,
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``is_top1`` (SFT's token accuracy) and ``log_sum_sq_probs`` (DPO's WPO weights) as TRL's
    kernel computes them: the label is the lowest-id maximum; log(sum p^2); no gradient; 0 /
    False where the label is -100."""
    from trl.trainer.utils import add_fused_lm_head as trl_add_fused_lm_head

    theirs, ours = _pair(model_dir, **attrs)
    outputs: tuple[str, ...] = ("log_probs", "entropy", "log_sum_sq_probs", "is_top1")
    if "final_logit_softcapping" not in attrs:  # refused under a softcap (tested below)
        outputs += ("mean_logits",)
    trl_add_fused_lm_head(theirs, temperature=temperature, outputs=outputs)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton: its kernels interpreted, fp32
    fh_trl.add_fused_lm_head(ours, temperature=temperature, outputs=outputs, head=backend)
    ids, mask, labels = _batch(3)
    with torch.no_grad():  # make about half of the scored labels the model's top-1
        hidden = ours.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        z = hidden.double() @ ours.lm_head.weight.double().T * attrs.get("output_multiplier", 1.0)
        cap = attrs.get("final_logit_softcapping")
        if cap is not None:
            z = cap * torch.tanh(z / cap)
        logp = torch.log_softmax(z / temperature, -1)
    top = logp.argmax(-1)
    y = labels[:, 1:]
    y.copy_(torch.where((y != IGNORE) & (torch.arange(9) % 2 == 0), top, y))
    a = theirs(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    b = ours(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert b.is_top1.dtype == torch.bool and b.log_sum_sq_probs.dtype == torch.float32
    assert b.is_top1.shape == b.log_sum_sq_probs.shape == (3, 9)
    assert torch.equal(b.is_top1, a.is_top1)
    scored = y != IGNORE
    assert torch.equal(b.is_top1, (y == top) & scored)
    assert 4 <= int(b.is_top1.sum()) < int(scored.sum())  # both values occur
    assert not b.log_sum_sq_probs.requires_grad and not b.is_top1.requires_grad
    tol = 1e-6 if temperature == 1.0 else 4e-6
    torch.testing.assert_close(b.log_sum_sq_probs, a.log_sum_sq_probs, rtol=0, atol=tol)
    want = torch.logsumexp(2 * logp, -1).masked_fill(~scored, 0)
    torch.testing.assert_close(b.log_sum_sq_probs.double(), want, rtol=0, atol=2e-6)
    assert bool((b.log_sum_sq_probs[~scored] == 0).all()) and not bool(b.is_top1[~scored].any())
    if "mean_logits" not in outputs:
        assert b.mean_logits is None
        return
    assert b.mean_logits.dtype == torch.float32 and not b.mean_logits.requires_grad
    torch.testing.assert_close(b.mean_logits, a.mean_logits, rtol=0, atol=1e-6)
    want_mean = (z / temperature).mean(-1).masked_fill(~scored, 0)
    torch.testing.assert_close(b.mean_logits.double(), want_mean, rtol=0, atol=1e-6)
    assert float(want_mean.abs().max()) > 0.01  # not vacuous


def test_shift_labels_num_items_and_plain_forward(model_dir: Path) -> None:
    from trl.trainer.utils import add_fused_lm_head as trl_add_fused_lm_head

    theirs, ours = _pair(model_dir)
    trl_add_fused_lm_head(theirs)
    plain_logits = ours(input_ids=_batch()[0]).logits
    fh_trl.add_fused_lm_head(ours, head="fusedhead:torch")
    ids, mask, labels = _batch(1)
    shifted = torch.roll(labels, -1, dims=1)
    shifted[:, -1] = IGNORE
    kw = dict(input_ids=ids, attention_mask=mask, shift_labels=shifted, fused_lm_head=True)
    a = theirs(**kw, num_items_in_batch=torch.tensor(7))
    b = ours(**kw, num_items_in_batch=torch.tensor(7))
    assert b.log_probs.shape == (3, 10) and b.entropy is None  # not asked for
    torch.testing.assert_close(b.log_probs, a.log_probs, rtol=0, atol=1e-6)
    torch.testing.assert_close(b.loss, a.loss, rtol=0, atol=1e-6)
    # without fused_lm_head the model is the one it was (generation is untouched)
    torch.testing.assert_close(ours(input_ids=_batch()[0]).logits, plain_logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs labels"):
        ours(input_ids=ids, fused_lm_head=True)


def test_moe_auxiliary_loss_matches(tmp_path: Path) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM
    from trl.trainer.utils import add_fused_lm_head as trl_add_fused_lm_head

    cfg = MixtralConfig(
        vocab_size=43,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    )
    torch.manual_seed(0)
    theirs = MixtralForCausalLM(cfg)
    ours = MixtralForCausalLM(cfg)
    ours.load_state_dict(theirs.state_dict())
    trl_add_fused_lm_head(theirs)
    fh_trl.add_fused_lm_head(ours, head="torch")
    ids, mask, labels = _batch(2)
    a = theirs(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    b = ours(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert a.aux_loss is not None and b.aux_loss is not None
    torch.testing.assert_close(b.aux_loss, a.aux_loss, rtol=0, atol=1e-7)
    torch.testing.assert_close(b.loss, a.loss, rtol=0, atol=1e-6)


def test_outputs_fusedhead_does_not_compute_are_refused(model_dir: Path) -> None:
    _, ours = _pair(model_dir)
    capped, _ = _pair(model_dir, model_type="gemma2", final_logit_softcapping=4.0)
    with pytest.raises(ValueError, match=r"\['mean_logits'\].*a logit softcap \(4\)"):
        fh_trl.add_fused_lm_head(capped, outputs=("log_probs", "mean_logits"), head="torch")
    with pytest.raises(ValueError, match="not fields TRL knows"):
        fh_trl.add_fused_lm_head(ours, outputs=("log_prob",), head="torch")
    with pytest.raises(TypeError, match="outputs must be a tuple"):
        fh_trl.add_fused_lm_head(ours, outputs="log_probs", head="torch")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="temperature must be a float"):
        fh_trl.add_fused_lm_head(ours, temperature="1", head="torch")  # type: ignore[arg-type]


def test_a_head_config_setting_what_trl_decides_is_refused(model_dir: Path, tmp_path: Path) -> None:
    """TRL's call passes its own temperature, the model's softcap, its labels and the outputs it
    wants: a head config that set one was ignored (or put a softcap on a model without one)."""
    _, ours = _pair(model_dir)
    for setting, decided_by in (
        ({"temperature": 0.5}, "the trainer's temperature"),
        ({"softcap": 3.0}, "final_logit_softcapping"),
        ({"return_entropy": False}, "the outputs TRL's trainer asks"),
    ):
        name = next(iter(setting))
        with pytest.raises(ValueError, match=f"^head sets {name}=.*{decided_by}"):
            fh_trl.add_fused_lm_head(ours, head=fusedhead.FusedHead(backend="torch", **setting))
        with pytest.raises(ValueError, match=f"^fused_head sets {name}="):  # before the model loads
            fh_trl.FusedHeadGRPOTrainer(
                model=str(model_dir),
                reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                args=trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[]),
                fused_head={"backend": "torch", **setting},
            )
    fh_trl.add_fused_lm_head(ours, head={"backend": "torch", "check_labels": False})  # its own


def test_backend_names_from_the_config_are_strict(model_dir: Path) -> None:
    _, ours = _pair(model_dir)
    with pytest.raises(UnknownBackendError, match="'tritonn'") as info:
        fh_trl.add_fused_lm_head(ours, head="tritonn")
    assert "torch" in str(info.value)
    with pytest.raises(ValueError, match="accepted forms"):
        fh_trl.add_fused_lm_head(ours, head="FusedHead:torch")

    cfg = fh_trl.FusedHeadGRPOConfig(
        output_dir="unused",
        fused_head_backend="fusedhead:torch",
        fused_head_options='{"chunk_rows": 16}',
        report_to="none",
        use_cpu=True,
    )
    head = fh_trl.fused_head_from_args(cfg)
    assert head == {"backend": "torch", "options": {"chunk_rows": 16}}
    assert lm_head_mod.resolve_lm_head(head).options.model_dump()["chunk_rows"] == 16
    with pytest.raises(ValueError, match="fused_head_options is not valid JSON"):
        fh_trl.FusedHeadGRPOConfig(  # refused when the config is built
            output_dir="unused", fused_head_options="{oops", report_to="none", use_cpu=True
        )
    with pytest.raises(UnknownBackendError, match="'tritonn'"):
        fh_trl.FusedHeadGRPOConfig(
            output_dir="unused", fused_head_backend="tritonn", report_to="none", use_cpu=True
        )


def test_trainer_without_the_field_fails_before_building(model_dir: Path) -> None:
    from trl import GRPOConfig

    args = GRPOConfig(output_dir="unused", report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="has no fused_head_backend"):
        fh_trl.FusedHeadGRPOTrainer(model=str(model_dir), reward_funcs=[], args=args)
    with pytest.raises(AttributeError, match="FusedHeadPPOTrainer"):
        fh_trl.FusedHeadPPOTrainer  # noqa: B018


def test_replace_refuses_a_trainer_without_trls_fused_head(model_dir: Path) -> None:
    _, ours = _pair(model_dir)

    class NotATrainer:
        model = ours
        ref_model = None

    with pytest.raises(RuntimeError, match="no model with TRL's fused LM head"):
        fh_trl.replace_trl_fused_heads(NotATrainer(), "torch")


@pytest.mark.parametrize("hide_transformers", [False, True], ids=["trl-file", "no-transformers"])
def test_grpo_bench_script_smoke(tmp_path: Path, hide_transformers: bool) -> None:
    """scripts/gpu/trl_grpo_bench.py on the CPU, TRL's kernel file loaded alone (as on a GPU box
    where TRL is installed with --no-deps, with or without transformers): both heads run and
    agree with float32 logits and with each other's gradients."""
    import json
    import os
    import subprocess
    import sys

    script = Path(__file__).parents[2] / "scripts" / "gpu" / "trl_grpo_bench.py"
    argv = [str(script), str(tmp_path), "--device", "cpu", "--small"]
    argv += ["--backend", "torch", "--standalone-trl"]
    # sys.modules["transformers"] = None makes it unimportable (and not found) in that process
    hide = "sys.modules['transformers'] = None; " if hide_transformers else ""
    code = f"import runpy, sys; {hide}sys.argv = {argv!r}; runpy.run_path({str(script)!r}, run_name='__main__')"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loaded alone" in proc.stdout and "fwd+bwd ms" in proc.stdout
    assert ("transformers is not installed" in proc.stdout) == hide_transformers
    record = json.loads((tmp_path / "trl_grpo_bench.json").read_text())
    assert record["shape"]["scored_tokens"] == 64 and record["fusedhead_backend"] == "torch"
    # errors against float64 logits within fp32's bound (atol = rtol = 1e-5, as assert_close64)
    scale = record["reference_max_abs"]
    assert record["check_rows"] == 32 and scale["log_probs"] > 1 and scale["entropy"] > 1
    for name in ("trl", "fusedhead"):
        r = record["results"][name]
        assert r["forward"]["ms_median"] > 0 and r["forward_backward"]["ms_median"] > 0
        assert r["logprob_max_abs_err"] <= 1e-5 * (1 + scale["log_probs"])
        assert r["entropy_max_abs_err"] <= 1e-5 * (1 + scale["entropy"])
    # the two fp32 heads agree with each other more closely than either with float64
    same = record["results"]["fusedhead"]["output_max_abs_diff_vs_trl"]
    assert same["log_probs"] < 1e-5 and same["entropy"] < 1e-5
    diff = record["results"]["fusedhead"]["grad_rel_diff_vs_trl"]
    assert diff["hidden"] < 1e-5 and diff["weight"] < 1e-5


def _run_offline(kind: str, model_dir: Path, out_dir: Path, backend: str | None) -> dict[str, Any]:
    """Two SFT, DPO or KTO steps on made-up text; every fused call's log-probs and the logs."""
    import trl
    from datasets import Dataset
    from trl_helpers import WORDS, make_tokenizer, record_fused_calls

    starts = range(0, 24, 3)
    prompts = [" ".join(WORDS[i : i + 3]) for i in starts]
    answers = [" ".join(WORDS[i + 3 : i + 6]) for i in starts]
    data: dict[str, list[Any]] = {
        "SFT": {"text": [" ".join(WORDS[i : i + 5 + i % 3]) for i in range(0, 32, 2)]},
        "DPO": {
            "prompt": prompts,
            "chosen": answers,
            "rejected": [" ".join(WORDS[i + 10 : i + 12]) for i in starts],
        },
        "KTO": {"prompt": prompts, "completion": answers, "label": [i % 2 == 1 for i in range(8)]},
    }[kind]
    common: dict[str, Any] = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=0.02,
        **CPU_STEPS,
    )
    if kind == "SFT":
        common["max_length"] = 16
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        train_dataset=Dataset.from_dict(data),
        processing_class=make_tokenizer(),
    )
    if backend is None:
        config = getattr(trl, f"{kind}Config")(**common)
        trainer: Any = getattr(trl, f"{kind}Trainer")(args=config, **kwargs)
    else:
        config = getattr(fh_trl, f"FusedHead{kind}Config")(fused_head_backend=backend, **common)
        trainer = getattr(fh_trl, f"FusedHead{kind}Trainer")(args=config, **kwargs)
    calls: list[tuple[str, torch.Tensor]] = []
    record_fused_calls(trainer.model, "policy", calls)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"calls": calls, "logs": logs, "trainer": trainer}


@pytest.mark.parametrize(
    ("kind", "metric"),
    [("SFT", "mean_token_accuracy"), ("DPO", "logits/chosen"), ("KTO", "logits/chosen")],
)
def test_offline_trainers_two_steps_match_trls_own_kernel(
    model_dir: Path, tmp_path: Path, kind: str, metric: str
) -> None:
    """SFT asks the fused head for ``is_top1`` (token accuracy), DPO and KTO for
    ``mean_logits`` (``logits/*``): each runs on fusedhead, and every logged metric is TRL's."""
    theirs = _run_offline(kind, model_dir, tmp_path / "trl", None)
    ours = _run_offline(kind, model_dir, tmp_path / "fusedhead", "fusedhead:torch")
    trainer = ours["trainer"]
    assert trainer.fused_head.name == "torch"
    assert fh_trl.fused_head_of(trainer.model.forward.previous) is trainer.fused_head
    assert len(theirs["calls"]) == len(ours["calls"]) >= 2
    for (_, a), (_, b) in zip(theirs["calls"], ours["calls"], strict=True):
        assert a.shape == b.shape and float(a.abs().max()) > 0.5
        assert float((a - b).abs().max()) <= 1e-6
    assert len(theirs["logs"]) == len(ours["logs"]) == 2
    for a, b in zip(theirs["logs"], ours["logs"], strict=True):
        assert a.keys() == b.keys() and metric in b and abs(b[metric]) > 0.01
        for key, value in a.items():  # fp32: 1e-6, relative above magnitude 1 (grad_norm ~30)
            if isinstance(value, float):
                assert abs(value - b[key]) <= 1e-6 * max(1.0, abs(value)), (key, value, b[key])


_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@_NO_CUDA
def test_a_backend_that_cannot_run_here_fails_when_the_config_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fusedhead.errors import BackendUnavailableError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    common = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(BackendUnavailableError) as err:
        fh_trl.FusedHeadGRPOConfig(fused_head_backend="fusedhead:triton", **common)
    text = str(err.value)
    # the field's value as written (not fusedhead's name for it), in the dtype TRL trains in
    assert "fused_head_backend='fusedhead:triton'" in text and "(cpu with torch.bfloat16)" in text
    assert "Fix:" in text and "'fusedhead:torch'" in text and "TRITON_INTERPRET=1" in text
    assert "here a backend's options go in fused_head_options" in text
    # where the backend can run, the same config builds: the interpreter, in fp32
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = fh_trl.FusedHeadGRPOConfig(fused_head_backend="fusedhead:triton", bf16=False, **common)
    assert args.fused_head_backend == "fusedhead:triton"
    assert fh_trl.trainer_device(args) == (torch.device("cpu"), None)


@_NO_CUDA
def test_a_backend_that_cannot_run_here_fails_before_the_trainer_loads_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer refuses ``fused_head=`` before TRL's init: the model path is never read."""
    import trl

    from fusedhead.errors import BackendUnavailableError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False)
    with pytest.raises(BackendUnavailableError) as err:
        fh_trl.FusedHeadGRPOTrainer(
            model=str(tmp_path / "no-such-model"),
            args=args,
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            fused_head="triton",
        )
    text = str(err.value)
    # the argument the user set, never the config field they did not
    assert "fused_head='triton' cannot run on this trainer's device (cpu, in any of" in text
    assert "fused_head_backend" not in text
    assert "set fused_head to a backend that runs on cpu here: 'torch'" in text


@pytest.mark.parametrize(
    ("where", "spec", "error", "words"),
    [
        ("keyword", "tritonn", UnknownBackendError, "names no installed fusedhead backend"),
        ("keyword", "FusedHead:triton", ValueError, "is not one of the accepted forms"),
        ("field", "tritonn", UnknownBackendError, "names no installed fusedhead backend"),
        ("field", "FusedHead:triton", ValueError, "is not one of the accepted forms"),
        ("field", "Torch", ValueError, "is not a backend name"),
        ("field", "fusedhaed:torch", ValueError, "is not a backend name"),
        ("keyword", "tor ch", ValueError, "is not a backend name"),
    ],
)
def test_a_bad_backend_name_is_reported_as_the_setting_that_holds_it(
    tmp_path: Path, where: str, spec: str, error: type[Exception], words: str
) -> None:
    """The trainer's ``fused_head=`` keyword, or the config's ``fused_head_backend`` field: an
    unknown or malformed name is that setting's value, refused before TRL's init."""
    import trl

    from fusedhead.integrations.lm_head import installed_backend_names

    common = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False)
    setting = "fused_head" if where == "keyword" else "fused_head_backend"
    with pytest.raises(error) as err:
        if where == "keyword":
            fh_trl.FusedHeadGRPOTrainer(
                model=str(tmp_path / "no-such-model"),
                args=trl.GRPOConfig(**common),
                reward_funcs=lambda completions, **_: [0.0] * len(completions),
                fused_head=spec,
            )
        else:
            fh_trl.FusedHeadGRPOConfig(fused_head_backend=spec, **common)
    text = str(err.value)
    assert f"{setting}={spec!r} {words}" in text, text
    assert "backend spec" not in text
    if error is UnknownBackendError:
        names = ", ".join(repr(n) for n in installed_backend_names())
        assert f"Fix: set {setting} to one of {names}" in text, text
    if words == "is not a backend name":  # the installed names, and the closest in its spelling
        names = ", ".join(repr(n) for n in installed_backend_names())
        assert f"set {setting} to one of {names}" in text, text
        meant = "fusedhead:torch" if spec.startswith("fused") else "torch"
        assert text.endswith(f"did you mean {meant!r}?"), text


def test_an_unknown_backend_option_names_fused_head_options(tmp_path: Path) -> None:
    """An option the backend does not take, given in the config's ``fused_head_options``: the
    error names that setting as written, the option and the backend's valid options."""
    from fusedhead.errors import OptionsError

    text = '{"memory": "fast"}'
    with pytest.raises(OptionsError) as err:
        fh_trl.FusedHeadGRPOConfig(
            output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
            fused_head_backend="torch", fused_head_options=text,
        )  # fmt: skip
    said = str(err.value)
    assert f"fused_head_options={text!r}: unknown option 'memory'" in said, said
    assert "valid options of 'torch': workspace_mib" in said, said


def test_the_trainer_classes_are_listed_before_they_are_built() -> None:
    """Built on first use, yet in ``dir()`` (tab completion) and ``__all__`` (``import *``)."""
    lazy = {
        f"FusedHead{k}{w}"
        for k in ("GRPO", "RLOO", "SFT", "DPO", "KTO")
        for w in ("Trainer", "Config")
    }
    assert lazy <= set(dir(fh_trl))
    assert lazy <= set(fh_trl.__all__)


# ---- Which trainers read a FusedHead*Config -----------------------------------------------------
# TRL's stock trainers read none of fused_head_backend / fused_head_options / fused_policy_loss:
# given one of fusedhead's configs they trained on TRL's own kernel and loss without a word.
# fused_policy_loss=True likewise needs FusedPolicyLossMixin before FusedHeadTrainerMixin: with
# the head mixin alone (as the docs showed) TRL's own _compute_loss ran. Both are refused when the
# trainer is built.


def _wiring_config(kind: str, tmp_path: Path, **fields: Any) -> Any:
    """``FusedHead{kind}Config`` for one CPU step of the tiny model, ``fields`` on top."""
    common: dict[str, Any] = dict(output_dir=str(tmp_path), max_steps=1, **CPU_STEPS)
    common["per_device_train_batch_size"] = 4
    if kind == "GRPO":  # beta 0: no reference model to load
        common.update(num_generations=4, max_completion_length=6, beta=0.0)
    common.update(fields)
    return getattr(fh_trl, f"FusedHead{kind}Config")(**common)


def _wiring_build(trainer_cls: type, args: Any, model_dir: Path) -> Any:
    """``trainer_cls`` (GRPO or SFT) on the tiny model and made-up prompts or text."""
    data: dict[str, list[str]] = {"prompt": [" ".join(WORDS[i : i + 3]) for i in range(0, 24, 3)]}
    kwargs: dict[str, Any] = dict(reward_funcs=reward_len)
    if issubclass(trainer_cls, trl.SFTTrainer):
        data, kwargs = {"text": [" ".join(WORDS[i : i + 6]) for i in range(0, 24, 3)]}, {}
    return trainer_cls(
        model=str(model_dir),
        args=args,
        train_dataset=Dataset.from_dict(data),
        processing_class=make_tokenizer(),
        **kwargs,
    )


class MixinOnlyGRPOTrainer(FusedHeadTrainerMixin, trl.GRPOTrainer):
    """What docs/integrations/trl.md used to show: the head mixin alone."""


class MyGRPOTrainer(FusedPolicyLossMixin, FusedHeadTrainerMixin, trl.GRPOTrainer):
    """A user's GRPO trainer with the bases in full."""


def test_the_stock_grpo_trainer_refuses_fusedheads_config(model_dir: Path, tmp_path: Path) -> None:
    args = _wiring_config("GRPO", tmp_path, fused_head_backend="torch", fused_policy_loss=True)
    with pytest.raises(TypeError) as info:
        _wiring_build(trl.GRPOTrainer, args, model_dir)
    text = str(info.value)
    assert text.startswith("GRPOTrainer was given a FusedHeadGRPOConfig"), text
    assert "fused_head_backend='torch'" in text and "fused_policy_loss=True" in text
    assert "TRL's own fused LM head and loss" in text
    assert "Build FusedHeadGRPOTrainer" in text
    assert "MyGRPOTrainer(FusedPolicyLossMixin, FusedHeadTrainerMixin, trl.GRPOTrainer)" in text


def test_the_stock_sft_trainer_refuses_fusedheads_config(model_dir: Path, tmp_path: Path) -> None:
    args = _wiring_config("SFT", tmp_path, fused_head_backend="fusedhead:torch", max_length=16)
    with pytest.raises(TypeError) as info:
        _wiring_build(trl.SFTTrainer, args, model_dir)
    text = str(info.value)
    assert text.startswith("SFTTrainer was given a FusedHeadSFTConfig"), text
    assert "fused_head_backend='fusedhead:torch'" in text and "fused_policy_loss" not in text
    assert "Build FusedHeadSFTTrainer" in text
    assert "MySFTTrainer(FusedHeadTrainerMixin, trl.SFTTrainer)" in text


def test_a_subclass_with_the_head_mixin_after_trls_trainer_is_refused(
    model_dir: Path, tmp_path: Path
) -> None:
    """The mixin after TRL's class never runs (transformers.Trainer.__init__ does not chain)."""

    class Late(trl.GRPOTrainer, FusedHeadTrainerMixin):
        pass

    with pytest.raises(TypeError, match=r"Late's FusedHeadTrainerMixin.__init__ does not run"):
        _wiring_build(Late, _wiring_config("GRPO", tmp_path), model_dir)


def test_the_head_mixin_alone_refuses_fused_policy_loss(model_dir: Path, tmp_path: Path) -> None:
    args = _wiring_config("GRPO", tmp_path, fused_policy_loss=True)
    with pytest.raises(TypeError) as info:
        _wiring_build(MixinOnlyGRPOTrainer, args, model_dir)
    text = str(info.value)
    assert text.startswith("MixinOnlyGRPOTrainer was given fused_policy_loss=True"), text
    assert "TRL's own _compute_loss would run" in text
    assert (
        "Add FusedPolicyLossMixin before FusedHeadTrainerMixin: class MixinOnlyGRPOTrainer("
        "FusedPolicyLossMixin, FusedHeadTrainerMixin, trl.GRPOTrainer)" in text
    )
    # without the fused loss the head mixin alone is enough
    trainer = _wiring_build(MixinOnlyGRPOTrainer, _wiring_config("GRPO", tmp_path), model_dir)
    assert fh_trl.fused_head_of(trainer.model) is trainer.fused_head


@pytest.mark.parametrize(
    ("bases", "refusal"),
    [
        (
            (FusedHeadTrainerMixin, FusedPolicyLossMixin, trl.GRPOTrainer),
            "has FusedHeadTrainerMixin before FusedPolicyLossMixin in its bases",
        ),
        (
            (FusedPolicyLossMixin, trl.GRPOTrainer),
            "has FusedPolicyLossMixin without FusedHeadTrainerMixin after it",
        ),
    ],
    ids=["mixins-swapped", "no-head-mixin"],
)
def test_the_policy_loss_mixin_in_the_wrong_place_is_refused(
    model_dir: Path, tmp_path: Path, bases: tuple[type, ...], refusal: str
) -> None:
    cls = type("Misordered", bases, {})
    with pytest.raises(TypeError, match=re.escape(f"Misordered {refusal}")):
        _wiring_build(cls, _wiring_config("GRPO", tmp_path, fused_policy_loss=True), model_dir)


@pytest.mark.parametrize(
    "trainer_cls",
    ["FusedHeadGRPOTrainer", MyGRPOTrainer],
    ids=["FusedHeadGRPOTrainer", "MyGRPOTrainer"],
)
def test_fusedheads_trainer_and_the_full_bases_build(
    model_dir: Path, tmp_path: Path, trainer_cls: Any
) -> None:
    cls = getattr(fh_trl, trainer_cls) if isinstance(trainer_cls, str) else trainer_cls
    args = _wiring_config("GRPO", tmp_path, fused_head_backend="torch", fused_policy_loss=True)
    trainer = _wiring_build(cls, args, model_dir)
    assert fh_trl.fused_head_of(trainer.model) is trainer.fused_head
    assert type(trainer)._compute_loss is FusedPolicyLossMixin._compute_loss


def test_a_users_own_get_process_log_level_call_returns_trls_value(tmp_path: Path) -> None:
    """Only transformers.Trainer.__init__ reading the config is checked; any other caller gets
    TRL's value (here a user, with the config's log levels)."""
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    for level in ("passive", "error"):
        ours = _wiring_config("GRPO", tmp_path, fused_policy_loss=True, log_level=level)
        assert (
            ours.get_process_log_level()
            == trl.GRPOConfig(log_level=level, **common).get_process_log_level()
        )
