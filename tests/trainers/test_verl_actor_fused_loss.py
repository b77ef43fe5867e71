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

import importlib.util
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (bash scripts/trainers/verl.sh)")

import verl  # noqa: F401  (the verl.plugins entry points, fusedhead's among them)

from fusedhead.integrations import verl as fh_verl
from fusedhead.integrations import verl_actor

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trainers"
#: SGD, so a parameter differs by lr times the summed gradient difference (Adam would divide
#: near-zero gradients by their own magnitude and amplify their last-ulp noise).
LR = 1e-2
SGD = {"optimizer": "SGD", "lr": LR, "weight_decay": 0.0}
#: 4 optimizer steps of lr 1e-2 over gradients that agree to ~1e-7 of their scale (grad_norm up
#: to ~50): at most ~2e-7 measured; 1e-6 leaves a factor 5 and is ~30 fp32 ulps of the weights.
PARAM_ATOL = 1e-6


def _example() -> Any:
    sys.path.insert(0, str(EXAMPLE))
    spec = importlib.util.spec_from_file_location(
        "verl_fused_policy_loss", EXAMPLE / "verl_fused_policy_loss.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ex = _example()


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
def test_fused_loss_from_config_matches_verls_actor(tiny: tuple[Path, int], case: str) -> None:
    path, vocab = tiny
    settings = dict(CASES[case])
    theirs, params_v = ex.train(path, vocab, fused=False, optim=SGD, **settings)
    ours, params_f = ex.train(path, vocab, fused=True, optim=SGD, **settings)
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


def test_fused_loss_needs_fusedheads_forward(tiny: tuple[Path, int]) -> None:
    """``loss_mode: fusedhead`` with verl's own ``impl_backend: torch``: refused by name."""
    from transformers import Qwen2ForCausalLM
    from transformers.integrations import flash_attention

    path, vocab = tiny
    model, config = ex.actor_configs(path, fused=True, backend="torch")
    forward, flash = Qwen2ForCausalLM.forward, flash_attention._flash_attention_forward
    fh_verl.fix_trl_value_head_probe()  # verl 0.9.1 beside TRL 1.16
    try:
        engine = ex.build_actor(model, config)
        batch = ex.rollout_batch(0, vocab)
        old = torch.full(batch["responses"].shape, -3.0)
        with pytest.raises(RuntimeError, match="impl_backend: fusedhead:<name>"):
            ex.update_actor(engine, config, batch, old)
    finally:
        Qwen2ForCausalLM.forward = forward  # type: ignore[method-assign]
        flash_attention._flash_attention_forward = flash
        fh_verl.fix_trl_value_head_probe(False)


def _config(**actor: Any) -> Any:
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    return FSDPActorConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode="fusedhead"),
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
        verl_actor.check_actor_config(_config(**actor))


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
