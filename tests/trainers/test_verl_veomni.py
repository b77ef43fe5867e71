"""verl's VeOmni engine with ``cross_entropy_loss_implementation: fusedhead:<name>``.

verl 0.9.1's ``VeOmniEngineWithLMHead`` builds the model with VeOmni's ``build_foundation_model``
and, with fused kernels, asks it for per-token log-probs (``return_log_probs=True`` and
``shift_labels`` = ``input_ids_rmpad_rolled``). fusedhead's ``verl.plugins`` entry point arms the
VeOmni integration when verl imports VeOmni, so the name in verl's config is all it takes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (bash scripts/trainers/verl.sh)")
pytest.importorskip("veomni", reason="VeOmni is not installed (bash scripts/trainers/veomni.sh)")

from veomni_helpers import assert_fp32_close, build, veomni_state
from verl_helpers import packed_micro_batch


@pytest.fixture(autouse=True)
def _installed() -> Iterator[None]:
    with veomni_state():
        yield


def _veomni_engine(model: Any) -> Any:
    """verl's ``VeOmniEngineWithLMHead`` with only what its input/output preparation reads."""
    from verl.workers.engine.veomni.transformer_impl import VeOmniEngineWithLMHead

    eng = object.__new__(VeOmniEngineWithLMHead)
    eng.pad_to_length = False
    eng.use_ulysses_sp = False
    eng.ulysses_sequence_parallel_size = 1
    eng.module = model
    eng._router_replay = None
    return eng


def _scored(model: Any, impl: str, micro_batch: Any) -> dict[str, torch.Tensor]:
    sys.modules[type(model).__module__].veomni_causal_lm_loss.bind(impl)  # a module-global slot
    eng = _veomni_engine(model)
    inputs, args = eng.prepare_model_inputs(micro_batch)
    assert inputs["return_log_probs"] is True and inputs["shift_labels"].shape == (1, 17)
    result = eng.prepare_model_outputs(model(**inputs), args, micro_batch, None)
    log_probs, entropy = result["log_probs"].values(), result["entropy"].values()
    (log_probs.sum() + 0.3 * entropy.sum()).backward()
    out = {"log_probs": log_probs.detach(), "entropy": entropy.detach()}
    for name, p in model.named_parameters():
        out[f"grad:{name}"] = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    return out


def test_verls_veomni_engine_feed_matches_veomnis_chunk_logprobs() -> None:
    theirs = build("chunk_loss")
    ours = build("fusedhead:torch", theirs.state_dict())
    batch = packed_micro_batch([5, 9, 3], seed=5, temperature=0.7)
    expected = _scored(theirs, "chunk_loss", batch)
    got = _scored(ours, "fusedhead:torch", batch)
    assert got.keys() == expected.keys()
    for key in got:
        assert_fp32_close(got[key], expected[key], key)
    assert got["log_probs"].shape == (17,) and bool((got["log_probs"] < 0).all())


def test_import_verl_arms_the_veomni_integration() -> None:
    code = (
        "import verl\n"
        "from veomni.ops.kernels import cross_entropy\n"
        "from fusedhead.integrations import veomni as fv\n"
        "print('OUT', fv.is_installed(), cross_entropy.install_loss_mapping('fusedhead:torch'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("OUT ")]
    assert lines == ["OUT True CrossEntropy (fusedhead:torch)"]


def _with_teacher(micro_batch: Any, lengths: list[int], k: int, seed: int) -> Any:
    """The micro-batch with a teacher's top-k (verl's teacher_ids / teacher_logprobs, jagged)."""
    from veomni_helpers import VOCAB
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(seed)
    ids = [
        torch.stack([torch.randperm(VOCAB, generator=gen)[:k] for _ in range(n)]) for n in lengths
    ]
    lps = [torch.log_softmax(torch.randn(n, k, generator=gen) * 3, -1) - 0.2 for n in lengths]
    micro_batch["teacher_ids"] = torch.nested.nested_tensor(ids, layout=torch.jagged)
    micro_batch["teacher_logprobs"] = torch.nested.nested_tensor(lps, layout=torch.jagged)
    tu.assign_non_tensor(micro_batch, distillation_use_topk=True)
    return micro_batch


def _distilled(model: Any, impl: str, micro_batch: Any) -> dict[str, torch.Tensor]:
    sys.modules[type(model).__module__].veomni_causal_lm_loss.bind(impl)
    eng = _veomni_engine(model)
    inputs, args = eng.prepare_model_inputs(micro_batch)
    assert inputs["teacher_topk_ids"].shape == (1, 17, 4)
    result = eng.prepare_model_outputs(model(**inputs), args, micro_batch, None)
    names = ("log_probs", "entropy", "distillation_losses", "student_mass", "teacher_mass")
    out = {name: result[name].values() for name in names}
    (out["distillation_losses"].sum() + 0.5 * out["log_probs"].sum()).backward()
    out = {name: value.detach() for name, value in out.items()}
    for name, p in model.named_parameters():
        out[f"grad:{name}"] = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    return out


def test_verls_veomni_engine_top_k_distillation_matches_veomnis_kernel() -> None:
    """``distillation_use_topk``: verl's engine hands the teacher's top-k to the loss kernel and
    reads distillation_losses / student_mass / teacher_mass back; fusedhead's equal VeOmni's."""
    theirs = build("chunk_loss")
    ours = build("fusedhead:torch", theirs.state_dict())
    lengths = [5, 9, 3]
    expected = _distilled(
        theirs, "chunk_loss", _with_teacher(packed_micro_batch(lengths, seed=6), lengths, 4, 7)
    )
    got = _distilled(
        ours, "fusedhead:torch", _with_teacher(packed_micro_batch(lengths, seed=6), lengths, 4, 7)
    )
    assert got.keys() == expected.keys()
    for key in got:
        assert_fp32_close(got[key], expected[key], key)
    assert got["distillation_losses"].shape == (17,)
    assert float(got["distillation_losses"].min()) > 0.1


@pytest.mark.parametrize("flag", ["use_fused_kernels", "use_remove_padding"])
def test_a_fusedhead_kernel_the_veomni_engine_would_never_call_is_refused(flag: str) -> None:
    """Without use_fused_kernels (or with use_remove_padding off) verl's VeOmni engine forms the
    full logits and never calls the configured kernel: that ran without a word."""
    from types import SimpleNamespace

    import verl  # noqa: F401 - arms fusedhead's verl patches (its verl.plugins entry point)
    from verl.utils import tensordict_utils as tu

    model = build("fusedhead:torch")
    eng = _veomni_engine(model)
    eng.engine_config = SimpleNamespace(cross_entropy_loss_implementation="fusedhead:torch")
    micro_batch = packed_micro_batch([5, 9, 3], seed=5, temperature=0.7)
    tu.assign_non_tensor(micro_batch, **{flag: False})
    if flag == "use_remove_padding":
        tu.assign_non_tensor(micro_batch, use_fused_kernels=True)
    with pytest.raises(
        ValueError,
        match=rf"cross_entropy_loss_implementation='fusedhead:torch' has no effect with {flag}=False",
    ):
        eng.forward_step(micro_batch, loss_function=None, forward_only=True)


def test_the_fused_policy_loss_on_the_veomni_engine_says_it_runs_on_fsdp_only() -> None:
    """It asked for fused_kernel_options.impl_backend, which the VeOmni engine never applies."""
    from types import SimpleNamespace

    from fusedhead.integrations import verl_actor

    eng = _veomni_engine(build("fusedhead:torch"))
    eng.engine_config = SimpleNamespace(cross_entropy_loss_implementation="fusedhead:torch")
    with pytest.raises(RuntimeError, match=r"runs on verl's FSDP engine \(model_engine: dp\) only"):
        verl_actor._check_engine(eng, None, None)
