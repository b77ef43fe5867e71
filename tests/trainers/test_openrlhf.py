"""OpenRLHF: ``patch_actor`` makes ``Actor.forward`` score with a fusedhead backend.

Log-probs, entropy and gradients of the patched actor are compared with OpenRLHF's own path
(full float32 logits) on the same model, packed (``packing_samples``) and not, at two
temperatures: on the positions OpenRLHF's losses read by default, on every position with
``score_all_positions=True``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fusedhead

STUBS = str(Path(__file__).parent / "openrlhf_stubs")
# flash-attn needs CUDA to build; OpenRLHF imports only its padding helpers (see the README). The
# stand-in is on the path for OpenRLHF's import only, then dropped, so no other test can see it.
_STUB = (
    importlib.util.find_spec("openrlhf") is not None
    and importlib.util.find_spec("flash_attn") is None
)
if _STUB:
    sys.path.insert(0, STUBS)
try:
    pytest.importorskip(
        "openrlhf.models.actor",
        reason="OpenRLHF is not installed (bash scripts/trainers/openrlhf.sh)",
    )
finally:
    if _STUB:
        sys.path.remove(STUBS)
        for _name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
            del sys.modules[_name]

from openrlhf.models.actor import Actor  # noqa: E402

from fusedhead.errors import UnknownBackendError  # noqa: E402
from fusedhead.integrations.openrlhf import is_patched, patch_actor, unpatch_actor  # noqa: E402

V = 53


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    fusedhead.refresh()
    yield
    fusedhead.refresh()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("openrlhf-model") / "tiny-llama"
    model.save_pretrained(path)
    return path


def _actor(model_dir: Path, packing: bool, temperature: float) -> Any:
    actor = Actor(
        str(model_dir),
        attn_implementation="eager",
        param_dtype="bf16",  # OpenRLHF loads bf16 or fp16; the test runs in float32
        packing_samples=packing,
        temperature=temperature,
    )
    return actor.float()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts, right-padded responses, as OpenRLHF's experience maker builds them."""
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(1, V, (3, 14), generator=g)
    mask = torch.ones_like(seq)
    mask[0, :3] = 0
    mask[1, :1] = 0
    mask[1, 12:] = 0
    mask[2, 10:] = 0
    seq = seq.masked_fill(mask == 0, 0)
    action_mask = mask[:, -6:].clone()
    return seq, mask, action_mask


def _entropy64(out: Any, packing: bool, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Entropy ``[B, T - 1]`` in float64 of the float32 logits OpenRLHF's own forward returned."""
    from openrlhf.models.ring_attn_utils import gather_and_pad_tensor, unpad_and_slice_tensor

    logp = torch.log_softmax(out["logits"].detach().double(), -1)
    ent = -(logp.exp() * logp).sum(-1)
    if packing:
        indices = unpad_and_slice_tensor(seq, mask, None)[4]
        ent = gather_and_pad_tensor(ent, None, 0, indices, *seq.shape)
    return ent[:, :-1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _grads(actor: Any) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
    actor.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(
    ("backend", "packing", "temperature"),
    [
        ("torch", False, 1.0),
        ("torch", False, 0.8),
        ("torch", True, 1.0),
        ("torch", True, 0.8),
        ("triton", False, 0.8),
        ("triton", True, 0.8),
    ],
)
def test_actor_forward_matches_openrlhf(
    model_dir: Path,
    backend: str,
    packing: bool,
    temperature: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``triton`` runs its kernels under the Triton interpreter on the CPU (fp32)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    theirs = _actor(model_dir, packing, temperature)
    ours = _actor(model_dir, packing, temperature)
    head = patch_actor(ours, f"fusedhead:{backend}")
    assert head.name == backend and is_patched(ours) and not is_patched(theirs)
    seq, mask, action_mask = _batch()
    needed = mask[:, 1:].bool()  # positions whose next token is real

    results = []
    for actor in (theirs, ours):
        lp, out = actor(
            seq, action_mask, attention_mask=mask, return_output=True, return_entropy=True
        )
        (lp.sum() + 0.1 * (out.entropy * needed).sum()).backward()
        results.append((lp, out, _grads(actor)))
    (lp_a, out_a, g_a), (lp_b, out_b, g_b) = results
    ent_a, ent_b = out_a.entropy, out_b.entropy
    assert lp_b.shape == lp_a.shape == action_mask.shape
    torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=1e-6)
    assert ent_b.shape == ent_a.shape == (3, 13)
    # OpenRLHF's entropy, logsumexp(z) - sum(p * z) in float32, subtracts two values near 5 here and
    # lands up to ~1.2e-6 off; both are held to float64 of OpenRLHF's own float32 logits.
    ent64 = _entropy64(out_a, packing, seq, mask)
    assert float((ent_b.double() - ent64)[needed].abs().max()) <= 1e-6
    assert float((ent_a.double() - ent64)[needed].abs().max()) <= 2e-6
    assert torch.all(ent_b[~needed] == 0)
    real = needed & mask[:, :-1].bool()  # both tokens real
    assert lp_a.abs().max() > 0.5 and ent_a[real].min() > 0.1
    assert g_a.keys() == g_b.keys() and "model.lm_head.weight" in g_b
    for name in g_a:
        assert _rel(g_b[name], g_a[name]) <= 1e-5, (name, _rel(g_b[name], g_a[name]))

    # all next-token log-probs (SFT / DPO): equal wherever the next token is real
    with torch.no_grad():
        full_a = theirs(seq, attention_mask=mask, return_logprobs=True)
        full_b = ours(seq, attention_mask=mask, return_logprobs=True)
    assert full_b.shape == full_a.shape == (3, 13)
    torch.testing.assert_close(full_b[needed], full_a[needed], rtol=0, atol=1e-6)
    assert torch.all(full_b[~needed] == 0)

    # every position, as OpenRLHF scores them (padding and wrap-around labels included)
    patch_actor(ours, "torch", score_all_positions=True)
    with torch.no_grad():
        lp_all, out_all = ours(
            seq, attention_mask=mask, return_logprobs=True, return_output=True, return_entropy=True
        )
        ref_lp, ref_out = theirs(
            seq, attention_mask=mask, return_logprobs=True, return_output=True, return_entropy=True
        )
    torch.testing.assert_close(lp_all, ref_lp, rtol=0, atol=1e-6)
    ent64 = _entropy64(ref_out, packing, seq, mask)
    assert float((out_all.entropy.double() - ent64).abs().max()) <= 1e-6
    assert float((ref_out.entropy.double() - ent64).abs().max()) <= 2e-6


POLICY_LOSSES = [
    {},
    {"dual_clip": 3.0, "clip_eps_high": 0.28},
    {"token_level_loss": False},
    {"policy_loss_type": "gspo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4},
    {"is_correction_level": "token", "is_correction_mode": "clip"},
    {"is_correction_level": "seq", "is_correction_mode": "mask"},
]


@pytest.mark.parametrize("options", POLICY_LOSSES, ids=lambda o: ",".join(o) or "ppo")
def test_openrlhf_policy_loss_on_the_patched_actor_matches(
    model_dir: Path, options: dict[str, Any]
) -> None:
    """OpenRLHF's own ``PolicyLoss`` (with an entropy bonus) on the patched actor's log-probs
    gives the unpatched actor's loss and gradients: each option keeps its meaning."""
    from openrlhf.models.loss import PolicyLoss

    seq, mask, action_mask = _batch()
    g = torch.Generator().manual_seed(3)
    advantages = torch.randn(action_mask.shape, generator=g)
    theirs = _actor(model_dir, False, 0.8)
    ours = _actor(model_dir, False, 0.8)
    patch_actor(ours, "torch")
    with torch.no_grad():
        old = theirs(seq, action_mask, attention_mask=mask)
    old = old + 0.05 * torch.randn(old.shape, generator=g)  # an off-policy step: ratios != 1
    rollout = old + 0.1 * torch.randn(old.shape, generator=g)
    loss_fn = PolicyLoss(**options)
    results = []
    for actor in (theirs, ours):
        lp, out = actor(
            seq, action_mask, attention_mask=mask, return_output=True, return_entropy=True
        )
        loss = loss_fn(lp, old, advantages, action_mask=action_mask, rollout_log_probs=rollout)
        loss = loss[0] if isinstance(loss, tuple) else loss
        entropy = out.entropy[:, -action_mask.shape[1] :]
        loss = loss - 0.01 * (entropy * action_mask).sum() / action_mask.sum()
        loss.backward()
        results.append((loss.detach(), _grads(actor)))
    (loss_a, g_a), (loss_b, g_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-7)
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        assert _rel(g_b[name], g_a[name]) <= 1e-5, (name, _rel(g_b[name], g_a[name]))


def test_logits_calls_keep_the_original_forward(model_dir: Path) -> None:
    theirs = _actor(model_dir, False, 1.0)
    ours = _actor(model_dir, False, 1.0)
    patch_actor(ours, "torch")
    seq, mask, _ = _batch()
    with torch.no_grad():
        a = theirs(seq, attention_mask=mask, return_output=True)
        b = ours(seq, attention_mask=mask, return_output=True)
    assert b["logits"].shape == (3, 14, V)
    torch.testing.assert_close(b["logits"], a["logits"], rtol=0, atol=0)
    unpatch_actor(ours)
    assert not is_patched(ours) and "forward" not in ours.__dict__


def test_bad_backends_and_inputs(model_dir: Path) -> None:
    actor = _actor(model_dir, False, 1.0)
    with pytest.raises(UnknownBackendError, match="'nope'") as info:
        patch_actor(actor, "fusedhead:nope")
    # named as the argument that held it, as written, with the fix in the same spelling
    assert str(info.value).startswith(
        "patch_actor(backend=...)='fusedhead:nope' names no installed fusedhead backend"
    )
    assert "Fix: set patch_actor(backend=...) to one of " in str(info.value)
    assert "'fusedhead:torch'" in str(info.value)
    assert not is_patched(actor)
    with pytest.raises(ValueError) as err:
        patch_actor(actor, "FusedHead:torch")
    assert str(err.value).startswith(
        "patch_actor(backend=...)='FusedHead:torch' is not one of the accepted forms"
    )
    # A backend that cannot run where the head's weight is: refused by patch_actor, named as
    # its argument (before: patched, then the first forward raised without naming it).
    from backend_stubs import gpu_only_backend

    from fusedhead.errors import BackendUnavailableError

    with gpu_only_backend(), pytest.raises(BackendUnavailableError) as unavailable:
        patch_actor(actor, "fusedhead:gpu-only-test")
    assert (
        "patch_actor(backend=...)='fusedhead:gpu-only-test' cannot run on this trainer's device "
        "(cpu with torch.float32)"  # the head's weight's device and dtype
    ) in str(unavailable.value), str(unavailable.value)
    assert "options go in a mapping: patch_actor(actor, {'backend'" in str(unavailable.value)
    assert "'fusedhead:torch'" in str(unavailable.value)  # the fix, in the same spelling
    assert not is_patched(actor)
    # A logit transform the fused head cannot reproduce, or a bad temperature: refused at setup
    # (before: log-probs 0.31 off for a padded vocabulary; the temperature at the first forward).
    actor.model.config.unpadded_vocab_size = V - 8
    with pytest.raises(ValueError, match=rf"^model.config.unpadded_vocab_size={V - 8} \(llama"):
        patch_actor(actor, "torch")
    del actor.model.config.unpadded_vocab_size
    actor.temperature = 0.0
    with pytest.raises(ValueError, match=r"^the actor's temperature \(OpenRLHF's --rollout.temp"):
        patch_actor(actor, "torch")
    actor.temperature = 1.0
    assert not is_patched(actor)
    with pytest.raises(TypeError, match="score_all_positions must be a bool"):
        patch_actor(actor, "torch", score_all_positions=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="openrlhf Actor"):
        patch_actor("actor", "torch")  # type: ignore[arg-type]
    patch_actor(actor, "torch")
    seq, mask, action_mask = _batch()
    with pytest.raises(ValueError, match="multimodal"):
        actor(seq, action_mask, attention_mask=mask, pixel_values=torch.zeros(1))
    with pytest.raises(ValueError, match="needs return_output=True"):
        actor(seq, action_mask, attention_mask=mask, return_entropy=True)
    with pytest.raises(ValueError, match="attention_mask is required"):
        actor(seq, action_mask)
    actor.temperature = 0.0  # changed after patching: named as at setup
    with pytest.raises(ValueError, match=r"^the actor's temperature \(OpenRLHF's --rollout.temp"):
        actor(seq, action_mask, attention_mask=mask)


@pytest.mark.parametrize(
    ("setting", "decided_by"),
    [
        ({"temperature": 0.5}, "--rollout.temperature"),
        ({"softcap": 1.0}, "final_logit_softcapping"),
        ({"ignore_index": 5}, "patch_actor"),
        ({"return_entropy": False}, "each call's return_entropy"),
    ],
)
def test_a_config_setting_the_actor_decides_is_refused(
    model_dir: Path, setting: dict[str, Any], decided_by: str
) -> None:
    """The actor's temperature, the model's softcap, the patch's labels and each call's
    return_entropy are what is scored with: a config setting one was ignored, or changed the
    policy (a softcap on a model without one), without a word."""
    actor = _actor(model_dir, False, 1.0)
    for backend in (
        {"backend": "torch", **setting},
        fusedhead.FusedHead(backend="torch", **setting),
    ):
        with pytest.raises(ValueError, match=f"sets {next(iter(setting))}=.*{decided_by}"):
            patch_actor(actor, backend)
        assert not is_patched(actor)
    patch_actor(actor, {"backend": "torch", "check_labels": False})  # the head's own: kept
    assert is_patched(actor)


def test_unpatch_gives_back_the_actors_own_forward_and_refuses_non_actors(model_dir: Path) -> None:
    actor = _actor(model_dir, False, 1.0)
    calls: list[bool] = []
    own = actor.forward

    def wrapped(*args: Any, **kwargs: Any) -> Any:  # a user's wrapper on this instance
        calls.append(True)
        return own(*args, **kwargs)

    actor.forward = wrapped
    patch_actor(actor, "torch")
    patch_actor(actor, "torch")  # patching twice keeps the wrapper to give back
    unpatch_actor(actor)
    assert not is_patched(actor) and actor.__dict__["forward"] is wrapped
    seq, mask, action_mask = _batch()
    with torch.no_grad():
        actor(seq, action_mask, attention_mask=mask)
    assert calls == [True]
    for bad in (None, "actor"):
        with pytest.raises(TypeError, match="openrlhf Actor"):
            is_patched(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="openrlhf Actor"):
            unpatch_actor(bad)  # type: ignore[arg-type]
    hf_model = actor.model  # a transformers model, not an Actor: its .model is the decoder
    with pytest.raises(TypeError, match=r"has no LM head .* must be an openrlhf Actor"):
        patch_actor(hf_model, "torch")


def test_an_actor_patched_before_prepare_on_a_gpu_machine_is_not_refused_for_its_cpu(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenRLHF loads the Actor on the CPU and strategy.prepare moves it to the GPU: patched
    before that, a GPU-only backend was refused for the CPU it was about to leave."""
    from backend_stubs import gpu_only_backend

    actor = _actor(model_dir, False, 1.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with gpu_only_backend():
        patch_actor(actor, "fusedhead:gpu-only-test")
        assert is_patched(actor)


def test_moe_aux_loss_and_hooked_head(tmp_path: Path) -> None:
    """A Mixtral actor: the model's own router loss comes back (``output.aux_loss``); the head's
    weight is read inside its own call (here a forward pre-hook must have run, as under ZeRO-3)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    path = tmp_path / "tiny-mixtral"
    MixtralForCausalLM(cfg).save_pretrained(path)
    theirs = _actor(path, False, 1.0)  # OpenRLHF sets output_router_logits for MoE configs
    ours = _actor(path, False, 1.0)
    assert ours.model.config.output_router_logits
    patch_actor(ours, "torch")
    calls: list[bool] = []
    ours.model.lm_head.register_forward_pre_hook(lambda mod, args: calls.append(True))
    seq, mask, action_mask = _batch()
    a, out_a = theirs(seq, action_mask, attention_mask=mask, return_output=True)
    b, out_b = ours(seq, action_mask, attention_mask=mask, return_output=True)
    assert calls == [True]
    torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert out_a.aux_loss is not None and out_b.aux_loss is not None
    torch.testing.assert_close(out_b.aux_loss, out_a.aux_loss, rtol=0, atol=1e-7)
    assert out_b.logits.shape == (3, 14, 0)  # no [B, T, V] logits


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero3_backward_gathers_the_head_weight_again(tmp_path: Path) -> None:
    """Under DeepSpeed ZeRO-3 the head's weight is released after its forward and gathered again
    by the hooks on the head's output before its backward: the patched actor's backward must
    reach them (it read a 0-element weight and failed), and give OpenRLHF's gradients, for an
    untied and a tied (Qwen2) head."""
    pytest.importorskip(
        "deepspeed", reason="DeepSpeed is not installed (scripts/trainers/openrlhf.sh)"
    )
    from spawned_ranks import run_ranks
    from zero3_workers import free_port, openrlhf_worker, tiny_qwen2_dirs

    dirs = tiny_qwen2_dirs(tmp_path, V)
    args = (dirs, V, str(tmp_path), free_port())
    run_ranks(openrlhf_worker, args, 1, tmp_path, "a ZeRO-3 step", 600)
    results = torch.load(tmp_path / "results.pt")
    for d in dirs:
        theirs, ours = results[d]["theirs"], results[d]["ours"]
        torch.testing.assert_close(ours["log_probs"], theirs["log_probs"], rtol=0, atol=1e-5)
        assert set(ours["grads"]) == set(theirs["grads"]) == {
            "lm_head.weight", "model.embed_tokens.weight"
        } - ({"lm_head.weight"} if "True" in d else set())  # fmt: skip
        for name, want in theirs["grads"].items():
            assert _rel(ours["grads"][name], want) < 1e-5, (d, name)


def test_a_scale_the_model_applies_before_its_head_is_not_applied_twice(tmp_path: Path) -> None:
    """MiniCPM3 divides the hidden states by ``logits_scaling`` before its LM head: the stand-in
    head receives them divided, so the patch must not scale again (it did: 46.7 off)."""
    from transformers import MiniCPM3Config, MiniCPM3ForCausalLM

    cfg = MiniCPM3Config(
        vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
        pad_token_id=0, dim_model_base=16,
    )  # fmt: skip
    assert cfg.logits_scaling == 4.0
    torch.manual_seed(0)
    model = MiniCPM3ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 3.0)
    path = tmp_path / "tiny-minicpm3"
    model.save_pretrained(path)
    theirs, ours = _actor(path, False, 0.8), _actor(path, False, 0.8)
    patch_actor(ours, "torch")
    seq, mask, action_mask = _batch()
    with torch.no_grad():
        a = theirs(seq, action_mask, attention_mask=mask)
        b = ours(seq, action_mask, attention_mask=mask)
    assert a.abs().max() > 1.0  # the scale matters here
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_flash_attn_stand_in_is_not_left_behind() -> None:
    """Other suites (verl, transformers) probe for flash-attn: they must not find the stand-in."""
    if not _STUB:
        pytest.skip("the real flash-attn is installed; no stand-in was used")
    assert "flash_attn" not in sys.modules and STUBS not in sys.path
    assert importlib.util.find_spec("flash_attn") is None


def _launcher_block() -> str:
    """The launcher in docs/integrations/openrlhf.md (its first Python block)."""
    doc = Path(__file__).parents[2] / "docs" / "integrations" / "openrlhf.md"
    text = doc.read_text(encoding="utf-8")
    start = text.index("```python\n") + len("```python\n")
    return text[start : text.index("```", start)]


def test_documented_launcher_patches_both_ray_actors(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The doc's launcher runs under Ray 2.60's rules: OpenRLHF's Ray actor classes are
    ``@ray.remote`` (subclassing one raises), so the launcher must subclass the plain classes."""
    import types

    ray = pytest.importorskip("ray", reason="Ray is installed with OpenRLHF")

    class Strategy:
        def prepare(self, model: Any) -> Any:  # DeepSpeed's prepare keeps the Actor
            return model

    class Policy:  # what OpenRLHF's PolicyModelActor builds: self.actor, prepared
        def init_model_from_pretrained(
            self, strategy: Any, pretrain: str, max_steps: Any = None, vllm_engines: Any = None
        ) -> None:
            self.actor = strategy.prepare(_actor(Path(pretrain), False, 0.7))

    class Reference:  # what OpenRLHF's ReferenceModelActor builds: self.model, prepared
        def init_model_from_pretrained(self, strategy: Any, pretrain: str) -> None:
            self.model = strategy.prepare(_actor(Path(pretrain), False, 0.7))

    # OpenRLHF's Ray modules import vLLM (not installed on the CPU): stand-ins with its classes.
    ppo_actor = types.ModuleType("openrlhf.trainer.ray.ppo_actor")
    ppo_actor.PolicyModelActor = ray.remote(num_gpus=1)(Policy)  # type: ignore[attr-defined]
    launcher = types.ModuleType("openrlhf.trainer.ray.launcher")
    launcher.ReferenceModelActor = ray.remote(num_gpus=1)(Reference)  # type: ignore[attr-defined]
    package = types.ModuleType("openrlhf.trainer.ray")
    package.__path__ = []
    package.ppo_actor, package.launcher = ppo_actor, launcher  # type: ignore[attr-defined]
    for module in (package, ppo_actor, launcher):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    import openrlhf.trainer

    monkeypatch.setattr(openrlhf.trainer, "ray", package, raising=False)
    ran: list[tuple[str, str]] = []
    monkeypatch.setattr(
        "runpy.run_module", lambda name, run_name, alter_sys: ran.append((name, run_name))
    )
    monkeypatch.setenv("FUSED_HEAD_BACKEND", "fusedhead:torch")

    exec(compile(_launcher_block(), "openrlhf.md", "exec"), {"__name__": "launch"})

    assert ran == [("openrlhf.cli.train_ppo_ray", "__main__")]
    policy_cls = ppo_actor.PolicyModelActor.__ray_actor_class__  # type: ignore[attr-defined]
    reference_cls = launcher.ReferenceModelActor.__ray_actor_class__  # type: ignore[attr-defined]
    assert issubclass(policy_cls, Policy) and policy_cls is not Policy
    assert issubclass(reference_cls, Reference) and reference_cls is not Reference
    policy, reference = policy_cls(), reference_cls()
    policy.init_model_from_pretrained(Strategy(), str(model_dir))
    reference.init_model_from_pretrained(Strategy(), str(model_dir))
    for actor in (policy.actor, reference.model):
        assert is_patched(actor)
        assert actor.__dict__["_fusedhead_head"].config.backend == "torch"
