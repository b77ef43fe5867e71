"""verl's own ``ppo_trainer.yaml`` with the overrides of docs/integrations/verl.md, as verl runs it.

The trainer config shipped inside the installed verl 0.9.1 is composed by hydra (its compose API
on the package's config directory, ``version_base=None`` as verl's ``main_ppo`` declares) with the
command-line overrides a user writes, and its ``actor_rollout_ref.model`` / ``.actor`` sections
become verl's config dataclasses as verl's worker builds them (``ActorRolloutRefWorker.init_model``:
``omega_conf_to_dataclass``, i.e. hydra's ``instantiate``; then ``actor.model_config = model``).
What the docs promise of that config: fusedhead's checks accept it, ``fused_policy_loss`` gets
the YAML's values, and a setting the fused loss cannot run with is refused by verl's name for it.
The model path is a tiny Qwen2 config and tokenizer written here (``HFModelConfig`` reads both).
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl is not installed (bash scripts/trainers/verl.sh)")
pytest.importorskip("hydra", reason="hydra-core is not installed (bash scripts/trainers/verl.sh)")

import torch
import verl  # the verl.plugins entry points, fusedhead's among them
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from omegaconf import DictConfig
from verl_helpers import restored_verl_patches, tiny_qwen2

from fusedhead.errors import CapabilityError, UnknownBackendError
from fusedhead.integrations import verl_config

#: hydra-core 1.3.8 calls OmegaConf 2.4's deprecated API (scripts/trainers/verl.sh keeps
#: setup.sh's OmegaConf); its two warnings per composition say nothing about verl or fusedhead.
pytestmark = [
    pytest.mark.filterwarnings(r"ignore:register_new_resolver\(\) is deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore:Implicit conversion from Version to str:FutureWarning"),
]
#: The directory ``verl/trainer/main_ppo.py`` composes from (``config_path="config"``).
CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"
TINY = Path(__file__).resolve().parents[2] / "examples" / "trainers" / "tiny.py"
ACTOR = "actor_rollout_ref.actor"
MODEL = "actor_rollout_ref.model"
#: docs/integrations/verl.md's command line: fused kernels on, a fusedhead backend, the fused
#: loss, FSDP2; what every verl run sets besides (a micro-batch size). ``use_remove_padding``
#: is left to verl's default, which is on.
USER = {
    f"{MODEL}.use_fused_kernels": "True",
    f"{MODEL}.fused_kernel_options.impl_backend": "fusedhead:torch",
    f"{ACTOR}.policy_loss.loss_mode": "fusedhead",
    f"{ACTOR}.strategy": "fsdp2",
    f"{ACTOR}.ppo_micro_batch_size_per_gpu": "2",
}
#: ``fused_policy_loss``'s keywords at verl's YAML defaults (clip 0.2 both ways, dual clip 3,
#: no entropy bonus, token-mean, no KL loss), one rank.
DEFAULT_KWARGS: dict[str, Any] = dict(
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=3.0,
    entropy_coef=0.0,
    aggregation="token-mean",
    loss_normalizer=None,
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2's config and the examples' word-level tokenizer, where ``model.path`` points."""
    spec = importlib.util.spec_from_file_location("tiny", TINY)
    assert spec is not None and spec.loader is not None
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = tiny.make_tokenizer()
    tiny.tiny_config("qwen2", len(tokenizer), architectures=["Qwen2ForCausalLM"]).save_pretrained(
        path
    )
    tokenizer.save_pretrained(path)
    return path


def composed(model_path: Path, **changes: str) -> DictConfig:
    """verl's ``ppo_trainer`` composed with :data:`USER`, ``model.path`` and ``changes``
    (``{"actor_rollout_ref.actor.clip_ratio_c": "2.5"}``: the command line's ``key=value``)."""
    overrides = {**USER, f"{MODEL}.path": str(model_path), **changes}
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(
            config_name="ppo_trainer", overrides=[f"{k}={v}" for k, v in overrides.items()]
        )


def verl_configs(config: DictConfig) -> tuple[Any, Any]:
    """``(HFModelConfig, FSDPActorConfig)`` as verl's ``ActorRolloutRefWorker.init_model``
    builds them from the composed config."""
    from verl.utils.config import omega_conf_to_dataclass

    model = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    actor.model_config = model
    return model, actor


def actor_changes(**settings: str) -> dict[str, str]:
    """``actor_rollout_ref.actor.<name>=<value>`` overrides."""
    return {f"{ACTOR}.{name}": value for name, value in settings.items()}


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_the_documented_command_line_builds_an_actor_fusedheads_checks_accept(
    model_path: Path, strategy: str
) -> None:
    """The docs' overrides reach verl's dataclasses as written (remove-padding by verl's default),
    and the setup check the engine runs before loading the model passes, under either strategy."""
    from verl.workers.config import FSDPActorConfig, HFModelConfig

    model, actor = verl_configs(composed(model_path, **{f"{ACTOR}.strategy": strategy}))
    assert type(model) is HFModelConfig and type(actor) is FSDPActorConfig
    assert model.use_fused_kernels is True
    assert model.use_remove_padding is True  # verl 0.9.1's model.yaml default
    assert model.fused_kernel_options["impl_backend"] == "fusedhead:torch"
    assert actor.policy_loss.loss_mode == "fusedhead"
    engine: Any = actor.engine  # the engine config verl's FSDP engine is built with
    assert actor.strategy == strategy and engine.strategy == strategy
    # what verl's FSDP engine runs when it is built: (actor config, model config, engine config)
    verl_config.check_fused_setup(actor, model, engine)
    assert verl_config.policy_loss_kwargs(actor) == DEFAULT_KWARGS


#: Actor settings moved away from verl's defaults on the command line, and the
#: ``fused_policy_loss`` keywords they must arrive as (one rank: no global batch info).
MAPPED: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "asym_clip+dual_clip+entropy+kl": (
        dict(
            clip_ratio_low="0.15",
            clip_ratio_high="0.28",
            clip_ratio_c="2.5",
            entropy_coeff="0.01",
            loss_agg_mode="seq-mean-token-mean",
            use_kl_loss="True",
            kl_loss_coef="0.05",
            kl_loss_type="kl",
        ),
        dict(
            DEFAULT_KWARGS,
            clip_low=0.15,
            clip_high=0.28,
            dual_clip=2.5,
            entropy_coef=0.01,
            aggregation="seq-mean-token-mean",
            kl_coef=0.05,
            kl_estimator="k1",
        ),
    ),
    "sum_norm+scale+mse_plus+negative_entropy": (
        dict(
            loss_agg_mode="seq-mean-token-sum-norm",
            loss_scale_factor="6",
            entropy_coeff="-0.002",
            use_kl_loss="True",
            kl_loss_type="mse+",
        ),
        dict(
            DEFAULT_KWARGS,
            entropy_coef=-0.002,
            aggregation="seq-mean-token-sum-norm",
            horizon=6.0,
            kl_coef=0.001,  # verl's default kl_loss_coef
            kl_estimator="k2",
        ),
    ),
    # clip_ratio counts where the YAML's own bounds are cleared (null), as in verl's loss
    "clip_ratio+bounds_null": (
        dict(clip_ratio="0.3", clip_ratio_low="null", clip_ratio_high="null"),
        dict(DEFAULT_KWARGS, clip_low=0.3, clip_high=0.3),
    ),
}


@pytest.mark.parametrize("case", sorted(MAPPED))
def test_the_yamls_actor_settings_arrive_as_the_fused_losss_arguments(
    model_path: Path, case: str
) -> None:
    """Each command-line value reaches ``fused_policy_loss``'s keyword, mapped as the docs'
    table says (verl's KL names as fusedhead's estimators), and the setup check still passes."""
    changes, expected = MAPPED[case]
    model, actor = verl_configs(composed(model_path, **actor_changes(**changes)))
    verl_config.check_fused_setup(actor, model, actor.engine)
    assert verl_config.policy_loss_kwargs(actor) == expected


def test_clip_ratio_alone_leaves_the_yamls_bounds_as_verls_own_loss_does(model_path: Path) -> None:
    """verl's actor.yaml sets ``clip_ratio_low`` and ``clip_ratio_high`` (0.2), which take
    precedence over ``clip_ratio``: ``clip_ratio=0.3`` alone moves neither bound, in verl's loss
    (a ratio of 1.25 with a positive advantage is clipped at 1.2) nor in fusedhead's."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    _, actor = verl_configs(composed(model_path, **actor_changes(clip_ratio="0.3")))
    assert actor.clip_ratio == 0.3  # the override arrived ...
    kwargs = verl_config.policy_loss_kwargs(actor)
    assert (kwargs["clip_low"], kwargs["clip_high"]) == (0.2, 0.2)  # ... and is not the bound
    old = torch.zeros(1, 4)
    new = torch.full((1, 4), math.log(1.25))
    _, metrics = compute_policy_loss_vanilla(
        old, new, torch.ones(1, 4), torch.ones(1, 4), "token-mean", actor, None
    )
    assert metrics["actor/pg_clipfrac"] == 1.0  # clipped: verl's upper bound is 0.2, not 0.3


def test_the_rollout_temperature_is_where_verls_trainer_reads_it(model_path: Path) -> None:
    """The temperature is not an actor setting: verl's trainer copies
    ``actor_rollout_ref.rollout.temperature`` onto each actor batch (``_update_actor``), from
    which fusedhead's forward hands it to the fused loss."""
    config = composed(model_path, **{"actor_rollout_ref.rollout.temperature": "0.7"})
    assert config.actor_rollout_ref.rollout.temperature == 0.7
    _, actor = verl_configs(config)
    assert "temperature" not in verl_config.policy_loss_kwargs(actor)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(clip_ratio_low="-0.1"), r"^clip_ratio_low must be a finite float >= 0, got -0\.1$"),
        (dict(clip_ratio_c="1.0"), r"^clip_ratio_c must be a finite float > 1 .*, got 1\.0$"),
        (dict(entropy_coeff="nan"), r"^entropy_coeff must be a finite float, got nan$"),
        (dict(use_kl_loss="True", kl_loss_type="full"), r"^kl_loss_type='full' is not computed"),
        (dict(loss_agg_mode="token_mean"), r"^loss_agg_mode='token_mean' .*'token-mean'\?$"),
        (
            {"policy_loss.loss_mode": "fused_head"},
            r"^actor_rollout_ref\.actor\.policy_loss\.loss_mode='fused_head' is not one of "
            r"verl's loss modes: did you mean 'fusedhead'",
        ),
    ],
    ids=["clip_ratio_low", "clip_ratio_c", "entropy_coeff", "kl_full", "agg_typo", "mode_typo"],
)
def test_an_actor_setting_the_fused_loss_refuses_stops_the_actor_configs_build(
    model_path: Path, settings: dict[str, str], message: str
) -> None:
    """Refused when verl instantiates ``actor_rollout_ref.actor``: hydra reports the key and
    the ``ValueError`` naming verl's option, before any engine or model exists."""
    config = composed(model_path, **actor_changes(**settings))
    with pytest.raises(InstantiationException) as err:
        verl_configs(config)
    cause = err.value.__cause__
    assert isinstance(cause, ValueError), repr(cause)
    assert re.search(message, str(cause)), str(cause)
    assert str(cause) in str(err.value) and f"full_key: {ACTOR}" in str(err.value)


def test_verls_own_loss_modes_keep_verls_checks(model_path: Path) -> None:
    """The same out-of-range value under ``loss_mode: vanilla`` is verl's to judge: built."""
    changes = actor_changes(clip_ratio_low="-0.1", **{"policy_loss.loss_mode": "vanilla"})
    _, actor = verl_configs(composed(model_path, **changes))
    assert actor.clip_ratio_low == -0.1 and actor.policy_loss.loss_mode == "vanilla"


_NEEDS = f"{ACTOR}.policy_loss.loss_mode='fusedhead' needs {MODEL}."
_BACKEND_IS = f"{MODEL}.fused_kernel_options.impl_backend is "


@pytest.mark.parametrize(
    ("changes", "error", "start"),
    [
        (
            {f"{MODEL}.use_fused_kernels": "False"},
            ValueError,
            f"{_NEEDS}use_fused_kernels: true (got use_fused_kernels=False)",
        ),
        (
            {f"{MODEL}.use_remove_padding": "False"},
            ValueError,
            f"{_NEEDS}use_remove_padding: true (got use_remove_padding=False)",
        ),
        (
            {f"{MODEL}.fused_kernel_options.impl_backend": "fusedhaed:torch"},
            ValueError,
            f"{_BACKEND_IS}'fusedhaed:torch', not a fusedhead backend",
        ),
        (
            {f"{MODEL}.fused_kernel_options.impl_backend": "torch"},
            ValueError,
            f"{_BACKEND_IS}'torch', verl's own fused kernel, whose forward returns log-probs",
        ),
        (
            {f"{ACTOR}.ulysses_sequence_parallel_size": "2"},
            ValueError,
            f"{ACTOR}.policy_loss.loss_mode='fusedhead' with ulysses_sequence_parallel_size=2",
        ),
        (
            {f"{MODEL}.fused_kernel_options.impl_backend": "fusedhead:liger"},
            CapabilityError,
            f"{MODEL}.fused_kernel_options.impl_backend='fusedhead:liger' names a backend that "
            "does not declare policy_loss on cpu",
        ),
        (
            {f"{MODEL}.fused_kernel_options.impl_backend": "fusedhead:no-such-backend"},
            UnknownBackendError,
            f"{MODEL}.fused_kernel_options.impl_backend='fusedhead:no-such-backend' names no "
            "installed fusedhead backend",
        ),
    ],
    ids=[
        "fused_kernels_off",
        "remove_padding_off",
        "backend_typo",
        "verls_backend",
        "ulysses",
        "backend_without_the_loss",
        "backend_not_installed",
    ],
)
def test_a_setup_the_fused_loss_cannot_run_is_refused_when_the_engine_is_built(
    model_path: Path, changes: dict[str, str], error: type[Exception], start: str
) -> None:
    """The actor config itself is valid; the check verl's FSDP engine runs before loading the
    model (``check_fused_setup`` on the actor, model and engine configs) names the setting."""
    model, actor = verl_configs(composed(model_path, **changes))
    with pytest.raises(error) as err:
        verl_config.check_fused_setup(actor, model, actor.engine)
    text = str(err.value)
    assert start in text, text
    if start.startswith(_BACKEND_IS):  # the fix offered: an installed backend with the loss
        assert "installed ones that compute the loss: 'fusedhead:torch'" in text
        typo = "fusedhaed" in start
        assert ("did you mean 'fusedhead:torch'?" in text) is typo, text
    if error is CapabilityError:  # the fix: the installed backends that compute the loss
        assert "'fusedhead:torch'" in text and "'fusedhead:triton'" in text, text
        assert "or loss_mode 'vanilla'" in text, text


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({f"{MODEL}.use_fused_kernels": "False"}, ValueError, "use_fused_kernels=False"),
        (
            {f"{MODEL}.fused_kernel_options.impl_backend": "fusedhaed:torch"},
            ValueError,
            "'fusedhaed:torch' is not a fused-kernel backend",
        ),
        (
            {f"{MODEL}.fused_kernel_options.impl_backend": "fusedhead:no-such-backend"},
            UnknownBackendError,
            "no-such-backend",
        ),
    ],
    ids=["fused_kernels_off", "backend_typo", "not_installed"],
)
def test_the_models_backend_values_are_refused_at_model_build_as_the_docs_table_says(
    model_path: Path, changes: dict[str, str], error: type[Exception], match: str
) -> None:
    """The docs' table, with verl's own loss (``loss_mode: vanilla``): the model section's values
    go to verl's ``apply_monkey_patch`` as its FSDP engine passes them, and are refused there."""
    from verl.models.transformers import monkey_patch

    changes = {f"{ACTOR}.policy_loss.loss_mode": "vanilla", **changes}
    model_config, _ = verl_configs(composed(model_path, **changes))
    model: Any = tiny_qwen2(0)
    forward = type(model).forward
    with restored_verl_patches(type(model)), pytest.raises(error, match=match):
        monkey_patch.apply_monkey_patch(
            model=model,
            use_remove_padding=model_config.use_remove_padding,
            use_fused_kernels=model_config.use_fused_kernels,
            fused_kernels_backend=model_config.fused_kernel_options.get("impl_backend"),
        )
    assert type(model).forward is forward  # refused before anything was patched
