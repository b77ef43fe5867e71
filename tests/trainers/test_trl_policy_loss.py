"""TRL: ``FusedHeadGRPOConfig(fused_policy_loss=True)`` computes GRPO's loss with fusedhead's
fused policy loss; every metric TRL logs must equal TRL's own loss path (its kernel, its
``_compute_loss``) over two offline CPU steps, and configs whose loss does not map are refused
by name when built."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fusedhead

pytest.importorskip("trl", reason="TRL is not installed (bash scripts/trainers/trl.sh)")

from trl_helpers import build_trainer, make_model_dir

from fusedhead.api import get_fused_head
from fusedhead.errors import CapabilityError
from fusedhead.integrations import trl as fh_trl
from fusedhead.integrations import trl_policy_loss


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    fusedhead.refresh()
    yield
    fusedhead.refresh()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("trl-policy-model"))


#: Two iterations per generation (TRL computes the old log-probs, so ratios move off 1), a
#: small clip range and a large step (tokens are clipped at step 2), KL to the reference on.
#: EOS made likelier (token 1, "[EOS]"), so completions differ in length: with equal lengths
#: grpo, bnpo, dr_grpo and dapo give one loss, and a mapping that swapped them would pass.
_MOVING = dict(
    num_iterations=2,
    epsilon=0.02,
    learning_rate=0.02,
    beta=0.1,
    use_bias_correction_kl=False,
    generation_kwargs={"sequence_bias": [[[1], 2.5]]},
)
CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo+entropy": dict(loss_type="bnpo", entropy_coef=0.05),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo+delta": dict(loss_type="dapo", epsilon_high=0.05, delta=1.5),
    # epsilon >= 1: the lower clip bound at or below 0, no lower clip; delta = inf: TRL's clamp
    # at inf, no dual clip
    "dapo, epsilon 1.5, delta inf": dict(
        loss_type="dapo", epsilon=1.5, epsilon_high=0.02, delta=float("inf")
    ),
    # TRL's default: no old log-probs computed (ratio exp(lp - lp.detach())), the fused loss
    # on-policy with old_log_probs=None
    "grpo on-policy": dict(loss_type="grpo", num_iterations=1, generation_kwargs=None),
    # A large step takes tokens' KL to the reference past 10, where verl's k3 clamps and TRL's
    # does not: the fused loss takes TRL's (k3-unclamped); with verl's, step 2 differed.
    "grpo far from the reference": dict(loss_type="grpo", learning_rate=0.05),
}


def _logs(trainer: Any) -> list[dict[str, float]]:
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("case", list(CASES))
def test_two_steps_log_what_trls_own_loss_logs(
    case: str,
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = {**_MOVING, **CASES[case]}
    theirs = _logs(build_trainer(model_dir, tmp_path / "trl", backend=None, **settings))
    fused_calls: list[Any] = []
    real = trl_policy_loss.lm_head_policy_loss

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        fused_calls.append(out)
        return out

    monkeypatch.setattr(trl_policy_loss, "lm_head_policy_loss", spy)
    trainer = build_trainer(
        model_dir, tmp_path / "fused", backend="torch", fused_policy_loss=True, **settings
    )
    caplog.set_level(logging.INFO, logger="fusedhead")
    ours = _logs(trainer)
    assert len(fused_calls) == 2, "one fused loss a step"
    said = [r.getMessage() for r in caplog.records if "runs inside the head" in r.getMessage()]
    assert len(said) == 1, f"the fused loss is announced once per LM head, got {said}"
    aggregation = fh_trl.POLICY_LOSS_TYPES[settings["loss_type"]]
    assert "backend 'torch'" in said[0] and f"aggregation {aggregation!r}" in said[0], said[0]
    assert len(theirs) == len(ours) == 2
    for step, (a, b) in enumerate(zip(theirs, ours, strict=True), 1):
        assert set(a) == set(b), (step, set(a) ^ set(b))
        for key in sorted(a):
            if key in ("step_time", "train_runtime") or not isinstance(a[key], float):
                continue
            if key == "grad_norm":  # a norm of ~17 in fp32: its ulp is 2e-6, compared relatively
                assert abs(a[key] - b[key]) <= 1e-6 * abs(a[key]), (step, key, a[key], b[key])
            else:
                assert abs(a[key] - b[key]) <= 1e-6, (step, key, a[key], b[key])
    last = ours[-1]
    if settings["generation_kwargs"] is not None:  # the loss types told apart
        lengths = [
            (h["completions/min_length"], h["completions/max_length"])
            for h in ours
            if "completions/min_length" in h
        ]
        assert lengths, "TRL logs its completions' lengths"
        assert any(lo < hi for lo, hi in lengths), f"one length tells no loss apart: {lengths}"
    assert last["kl"] > 1e-4, "step 2 must see a policy that moved from the reference"
    if settings["num_iterations"] > 1:
        assert last["clip_ratio/region_mean"] > 0, "step 2 must clip some tokens"
    else:
        assert all(c.metrics()["approx_kl"].item() == 0.0 for c in fused_calls), "on-policy"
    assert abs(last["loss"]) > 1e-4


def _config(model_dir: Path, tmp_path: Path, **overrides: Any) -> Any:
    base: dict[str, Any] = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        fused_policy_loss=True,
        use_bias_correction_kl=False,
    )
    base.update(overrides)
    return fh_trl.FusedHeadGRPOConfig(**base)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (dict(loss_type="cispo"), "loss_type='cispo'"),
        (dict(loss_type="sapo"), "loss_type='sapo'"),
        (dict(importance_sampling_level="sequence"), "importance_sampling_level='sequence'"),
        (dict(delta=1.1, epsilon_high=0.28), "delta=1.1"),
        (dict(beta=0.1, use_bias_correction_kl=True), "use_bias_correction_kl=True"),
        (dict(top_entropy_quantile=0.2), "top_entropy_quantile=0.2"),
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold=0.5"),
        (dict(use_adaptive_entropy=True), "use_adaptive_entropy=True"),
        (dict(loss_type="grpo", entropy_coef=0.01), "entropy_coef=0.01"),
        # each value fused_policy_loss takes, refused by TRL's name when the config is built
        # (before, a non-finite or negative one failed at the first step under fusedhead's name)
        (dict(epsilon=-0.1), "epsilon must be a finite float >= 0, got -0.1"),
        (dict(epsilon_high=-0.1), "epsilon_high must be a finite float >= 0, got -0.1"),
        (dict(epsilon_high=float("inf")), "epsilon_high must be a finite float >= 0, got inf"),
        (dict(epsilon=float("nan")), "epsilon must be a finite float >= 0, got nan"),
        (dict(beta=-0.1), "beta must be a finite float >= 0 (the KL coefficient), got -0.1"),
        (dict(entropy_coef=float("inf")), "entropy_coef must be a finite float, got inf"),
        (dict(delta=float("nan")), "delta=nan"),
    ],
)
def test_configs_that_do_not_map_are_refused_when_built(
    model_dir: Path, tmp_path: Path, overrides: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(named)) as info:
        _config(model_dir, tmp_path, **overrides)
    assert "fused_policy_loss=False" in str(info.value)
    if "use_bias_correction_kl" in named:  # TRL's default is the refused True: the fix says so
        assert "set use_bias_correction_kl=False" in str(info.value)
    # the same settings without the fused loss are TRL's to run
    _config(model_dir, tmp_path, **{**overrides, "fused_policy_loss": False})


@pytest.mark.parametrize("value", ["no", "false", 1, 0, None])
def test_the_switch_is_true_or_false(model_dir: Path, tmp_path: Path, value: object) -> None:
    """``fused_policy_loss="no"`` was truthy: the fused loss ran under a name that said off."""
    with pytest.raises(TypeError, match=rf"fused_policy_loss must be True or False, got {value!r}"):
        _config(model_dir, tmp_path, fused_policy_loss=value)


def test_a_backend_of_none_is_named_as_such(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"FusedHeadGRPOConfig\(fused_head_backend=None\): name"):
        _config(model_dir, tmp_path, fused_head_backend=None)


def test_vllm_importance_sampling_maps_only_per_token_truncation() -> None:
    from types import SimpleNamespace

    from trl import GRPOConfig

    args = SimpleNamespace(
        **{f.name: f.default for f in GRPOConfig.__dataclass_fields__.values() if f.init},
    )
    args.__dict__.update(
        fused_policy_loss=True, use_vllm=True, vllm_importance_sampling_correction=True
    )
    args.__dict__.update(use_bias_correction_kl=False, use_cpu=True, fused_head_backend="torch")
    args.__dict__.update(vllm_importance_sampling_mode="token_truncate")
    fh_trl.check_policy_loss_args(args)  # with TRL's clip_max 3.0 and no clip_min
    for name, value in (
        ("vllm_importance_sampling_mode", "sequence_truncate"),
        ("vllm_importance_sampling_mode", "token_mask"),
        ("vllm_importance_sampling_clip_min", 0.5),
        ("vllm_importance_sampling_clip_max", None),
    ):
        bad = SimpleNamespace(**{**vars(args), name: value})
        with pytest.raises(ValueError, match=f"{name}={value!r}"):
            fh_trl.check_policy_loss_args(bad)


def test_a_backend_without_the_policy_loss_is_refused(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    head = get_fused_head("torch")
    caps = head.capabilities("cpu")
    monkeypatch.setattr(
        type(head),
        "capabilities",
        lambda self, device: caps.model_copy(update={"policy_loss": False}),
    )
    with pytest.raises(CapabilityError, match="fused_policy_loss=True needs a backend"):
        _config(model_dir, tmp_path)


def test_the_trainer_checks_the_config_it_is_given(model_dir: Path, tmp_path: Path) -> None:
    """A config changed after it was built is checked again when the trainer is built, before the
    model loads (the trainer's check used to read ``*args``, never the config, and did not run)."""
    args = _config(model_dir, tmp_path)
    args.loss_type = "cispo"
    with pytest.raises(
        ValueError, match=re.escape("fused_policy_loss=True with loss_type='cispo'")
    ):
        fh_trl.FusedHeadGRPOTrainer(model=str(model_dir), reward_funcs=[], args=args)
