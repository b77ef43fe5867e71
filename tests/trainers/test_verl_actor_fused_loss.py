"""verl's actor with ``policy_loss.loss_mode: fusedhead`` against verl's own loss, on the CPU.

verl 0.9.1's actor engine (``FSDPEngineWithLMHead``, FSDP2, one gloo rank, a tiny Qwen2 built
here) runs two ``update_actor`` calls (2 mini-batches x 2 packed micro-batches each) once as verl
ships it and once switched to the fused loss by the config
(examples/trainers/verl_fused_policy_loss.py holds the harness: verl's config dataclasses, its
engine, its trainer's batch flags and metric reduction). Every logged metric must agree to 6
decimals (relatively above 1: fp32 holds 7 digits, so ``grad_norm`` ~ 50 cannot be held to 1e-6
absolute) and the parameters after the steps closely (see :data:`PARAM_ATOL`).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (bash scripts/trainers/verl.sh)")

import verl  # noqa: F401  (the verl.plugins entry points, fusedhead's among them)
from verl_helpers import fused_policy_loss_example

from fusedhead.integrations import verl as fh_verl
from fusedhead.integrations import verl_config

#: SGD, so a parameter differs by lr times the summed gradient difference (Adam would divide
#: near-zero gradients by their own magnitude and amplify their last-ulp noise).
LR = 1e-2
SGD = {"optimizer": "SGD", "lr": LR, "weight_decay": 0.0}
#: 4 optimizer steps of lr 1e-2 over gradients that agree to ~1e-7 of their scale (grad_norm up
#: to ~50): at most ~2e-7 measured; 1e-6 leaves a factor 5 and is ~30 fp32 ulps of the weights.
PARAM_ATOL = 1e-6


ex = fused_policy_loss_example()


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[Path, int]]:
    """The tiny model on disk, verl's platform as the CPU, one gloo rank; all undone after."""
    with tempfile.TemporaryDirectory() as tmp, ex.cpu_platform():
        started = not torch.distributed.is_initialized()
        try:
            yield ex.save_tiny_qwen2(Path(tmp))
        finally:
            if started and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def _tol(value: float) -> float:
    return 1e-6 * max(1.0, abs(value))


CASES = {
    "token-mean+entropy+low_var_kl+dual_clip": dict(
        loss_agg_mode="token-mean",
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.05,
        kl_loss_type="low_var_kl",
        clip_ratio_c=2.0,
    ),
    "seq-mean-token-mean+k1+no_entropy+asym_clip+tis": dict(
        loss_agg_mode="seq-mean-token-mean",
        entropy_coeff=0.0,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="kl",
        clip_ratio_low=0.1,
        clip_ratio_high=0.28,
        is_weights=True,
    ),
    "seq-mean-token-sum-norm+mse+scale": dict(
        loss_agg_mode="seq-mean-token-sum-norm",
        entropy_coeff=0.02,
        use_kl_loss=True,
        kl_loss_type="mse",
        loss_scale_factor=6,
    ),
    "token-sum": dict(loss_agg_mode="token-sum", entropy_coeff=0.01),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_loss_from_config_matches_verls_actor(
    tiny: tuple[Path, int], case: str, caplog: pytest.LogCaptureFixture
) -> None:
    path, vocab = tiny
    settings = dict(CASES[case])
    theirs, params_v = ex.train(path, vocab, fused=False, optim=SGD, **settings)
    caplog.set_level(logging.INFO, logger="fusedhead")
    ours, params_f = ex.train(path, vocab, fused=True, optim=SGD, **settings)
    said = [r.getMessage() for r in caplog.records if "runs inside the head" in r.getMessage()]
    assert len(said) == 1, f"the fused loss is announced once per LM head, got {said}"
    assert len(theirs) == len(ours) == 2
    clipped = 0.0
    for step, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert set(a) == set(b), (step, sorted(set(a) ^ set(b)))
        assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "grad_norm"} <= set(a)
        assert ("actor/entropy_loss" in a) == (settings["entropy_coeff"] != 0.0)
        assert ("kl_loss" in a) == settings.get("use_kl_loss", False)
        for key, value in a.items():
            assert abs(b[key] - value) <= _tol(value), (case, step, key, b[key], value)
        clipped += a["actor/pg_clipfrac"]
    assert clipped > 0  # the clipped branch was exercised, not only the unclipped one
    assert params_v.keys() == params_f.keys()
    for name, p in params_v.items():
        torch.testing.assert_close(params_f[name], p, atol=PARAM_ATOL, rtol=0.0, msg=name)
    worst = max(float((p - params_f[n]).abs().max()) for n, p in params_v.items())
    print(f"{case}: parameters after 4 SGD steps within {worst:.1e}")


@contextlib.contextmanager
def _restored_forward() -> Iterator[None]:
    """verl's apply_monkey_patch patches Qwen2's class forward and flash attention: undone."""
    from transformers import Qwen2ForCausalLM
    from transformers.integrations import flash_attention

    forward, flash = Qwen2ForCausalLM.forward, flash_attention._flash_attention_forward
    fh_verl.fix_trl_value_head_probe()  # verl 0.9.1 beside TRL 1.16
    try:
        yield
    finally:
        Qwen2ForCausalLM.forward = forward  # type: ignore[method-assign]
        flash_attention._flash_attention_forward = flash
        fh_verl.fix_trl_value_head_probe(False)


@pytest.mark.parametrize("backend", ["torch", "triton", "liger", "fused-kernels-of-my-own"])
def test_a_non_fusedhead_impl_backend_is_refused_when_the_actor_is_built(
    tiny: tuple[Path, int], backend: str
) -> None:
    """``loss_mode: fusedhead`` with an ``impl_backend`` that is not ``fusedhead:<name>``, set up
    as the example does (verl's FSDP2 engine, then the old log-probs pass): refused by name when
    the engine is built, before the model is loaded and before verl's own forward runs into it
    (verl's own kernels fail under FSDP2 with "mixed torch.Tensor and DTensor", #5633)."""
    path, _ = tiny
    model, config = ex.actor_configs(path, fused=True, backend=backend)
    with _restored_forward(), pytest.raises(ValueError) as err:
        ex.build_actor(model, config)
    text = str(err.value)
    assert "actor_rollout_ref.actor.policy_loss.loss_mode='fusedhead'" in text
    assert f"actor_rollout_ref.model.fused_kernel_options.impl_backend is {backend!r}" in text
    assert "set impl_backend: fusedhead:<name> (installed ones that compute the loss: " in text
    assert "'fusedhead:torch'" in text and "'fusedhead:triton'" in text
    assert "'fusedhead:liger'" not in text  # installed, but it computes no policy loss
    assert "DTensor" not in text


def test_a_setting_the_fused_loss_needs_is_checked_at_the_first_forward_whatever_the_pass(
    tiny: tuple[Path, int],
) -> None:
    """An actor config with ``loss_mode: fusedhead`` that holds the engine's model config only
    after the engine was built is checked at the engine's first forward: here a forward-only
    pass (the old log-probs), with fused kernels off."""
    path, vocab = tiny
    model, _ = ex.actor_configs(path, fused=False)
    with _restored_forward():
        engine = ex.build_actor(model, ex.actor_configs(path, fused=False)[1])
        config = _config()
        config.model_config = engine.model_config
        with pytest.raises(ValueError) as err:
            ex.old_log_probs(engine, config, ex.rollout_batch(0, vocab))
    assert str(err.value).startswith(
        "actor_rollout_ref.actor.policy_loss.loss_mode='fusedhead' needs "
        "actor_rollout_ref.model.use_fused_kernels: true (got use_fused_kernels=False)"
    )


def test_an_unavailable_backend_is_checked_in_the_dtype_verls_engine_computes_in(
    tiny: tuple[Path, int],
) -> None:
    """In verl's FSDP engine the head computes in ``mixed_precision.param_dtype``: the backend
    is checked, and reported, in that dtype (fp32 in the example), not one it happens to
    declare; the value is echoed as written."""
    from backend_stubs import gpu_only_backend

    from fusedhead.errors import BackendUnavailableError

    path, _ = tiny
    model, config = ex.actor_configs(path, fused=True, backend="fusedhead:gpu-only-test")
    with (
        gpu_only_backend() as checked,
        _restored_forward(),
        pytest.raises(BackendUnavailableError) as err,
    ):
        ex.build_actor(model, config)
    assert checked[0] == torch.float32
    assert (
        "actor_rollout_ref.model.fused_kernel_options.impl_backend='fusedhead:gpu-only-test' "
        "cannot run on this trainer's device (cpu with torch.float32)"
    ) in str(err.value)


def _config(**actor: Any) -> Any:
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    return FSDPActorConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=1,
        policy_loss=actor.pop("policy_loss", PolicyLossConfig(loss_mode="fusedhead")),
        **actor,
    )


@pytest.mark.parametrize(
    ("actor", "match"),
    [
        (dict(use_kl_loss=True, kl_loss_type="full"), "kl_loss_type='full'"),
        (dict(use_prefix_grouper=True), "use_prefix_grouper"),
    ],
)
def test_refused_settings_are_named(actor: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        verl_config.check_actor_config(_config(**actor))


def test_verls_actor_config_is_refused_when_built_by_verls_names() -> None:
    """``loss_mode: fusedhead`` with a value the fused loss refuses: the config itself (as hydra
    builds it) is refused, naming verl's option."""
    with pytest.raises(
        ValueError, match=r"^clip_ratio_low must be a finite float >= 0, got -0\.1$"
    ):
        _config(clip_ratio_low=-0.1)
    _config(clip_ratio_low=1.5)  # verl's "no lower clip", as verl runs it
    with pytest.raises(ValueError, match="did you mean 'low_var_kl'"):
        _config(use_kl_loss=True, kl_loss_type="lowvar_kl")
    # before verl's own check, which says "Invalid loss_agg_mode: token_mean" and lists nothing
    with pytest.raises(ValueError, match=r"^loss_agg_mode='token_mean' is not one of verl's \[.*"
                       r"did you mean 'token-mean'\?$"):  # fmt: skip
        _config(loss_agg_mode="token_mean")
    from verl.workers.config import PolicyLossConfig

    for typo in ("fused_head", "fusedHead", "fused-head"):  # when built, not at the first step
        with pytest.raises(ValueError, match=rf"loss_mode='{typo}' is not one of verl's loss "
                           r"modes: did you mean 'fusedhead'"):  # fmt: skip
            _config(policy_loss=PolicyLossConfig(loss_mode=typo))
    _config(policy_loss=PolicyLossConfig(loss_mode="gpg"))  # verl's own modes stay verl's
    vanilla = PolicyLossConfig(loss_mode="vanilla")
    _config(clip_ratio_low=-0.1, policy_loss=vanilla)  # verl's own loss modes: verl's to check


def test_loss_mode_is_registered_and_guarded() -> None:
    """verl's registry knows ``fusedhead``: vanilla without gradients, refused in a train step."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, get_policy_loss_fn

    assert fh_verl.fused_policy_loss_enabled()
    fn = get_policy_loss_fn("fusedhead")
    config = _config(clip_ratio_c=2.0)
    g = torch.Generator().manual_seed(0)
    old, new, adv = (torch.randn(3, 5, generator=g) for _ in range(3))
    mask = torch.ones(3, 5, dtype=torch.bool)
    with torch.no_grad():
        got = fn(old, new, adv, mask, "token-mean", config)
    want = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", config)
    assert float(got[0]) == float(want[0]) and got[1] == want[1]
    with pytest.raises(RuntimeError, match="computed inside verl's FSDP engine"):
        fn(old, new.requires_grad_(), adv, mask, "token-mean", config)
