"""fusedhead inside verl 0.9.1: ``fused_kernel_options.impl_backend: fusedhead:<name>``.

The batches go through verl's own ``FSDPEngineWithLMHead.prepare_model_inputs`` /
``prepare_model_outputs`` (packed remove-padding micro-batches, ``shift_labels`` =
``input_ids_rmpad_rolled``), and the model is patched by verl's own ``apply_monkey_patch``, which
reaches fusedhead only through the ``verl.plugins`` entry point.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (bash scripts/trainers/verl.sh)")
pytest.importorskip("transformers", reason="transformers is not installed")

from spawned_ranks import run_ranks
from verl_helpers import (
    HIDDEN,
    VOCAB,
    apply_verl_monkey_patch,
    assert_body_grad_close,
    assert_fp32_close,
    packed_micro_batch,
    restored_verl_patches,
    scored,
    tiny_qwen2,
)

from fusedhead.errors import UnknownBackendError
from fusedhead.integrations import verl as fh_verl

HERE = Path(__file__).parent


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_verls_plugin_switch_turns_the_entry_point_off() -> None:
    """``VERL_USE_EXTERNAL_PLUGINS=none`` skips it; with the default, ``import verl`` loads it
    (that side runs in :func:`test_the_docs_example_runs`, whose example relies on it)."""
    code = (
        "import verl\n"
        "from verl.models.transformers import monkey_patch\n"
        "from fusedhead.integrations import verl as fv\n"
        "print('OUT', monkey_patch.patch_forward_with_backends is fv.patch_forward_with_backends)\n"
    )
    off = _python(code, VERL_USE_EXTERNAL_PLUGINS="none")
    assert off.returncode == 0, off.stderr[-3000:]
    assert [line for line in off.stdout.splitlines() if line.startswith("OUT ")] == ["OUT False"]


def test_the_entry_point_module_imports_neither_torch_nor_verl() -> None:
    code = (
        "import sys\n"
        "import fusedhead.integrations._verl_plugin\n"
        "from fusedhead.integrations import verl as fv\n"
        "print(sorted(m for m in ('torch', 'verl', 'transformers') if m in sys.modules))\n"
        "print(fv.is_installed())\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["[]", "True"]


@pytest.mark.parametrize(
    ("backend", "temperature"),
    [("fusedhead:torch", 1.0), ("fusedhead:torch", 0.7), ("fusedhead:triton", 0.7)],
)
def test_packed_batch_matches_verls_own_torch_path(
    backend: str, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """log_probs, entropy and every parameter's gradient equal verl's fused torch path.

    ``fusedhead:triton`` runs its kernels under the Triton interpreter on the CPU (set here for
    this test, as tests/triton_backend does, so a CUDA machine runs it the same way).
    """
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    base = tiny_qwen2(0)
    batch = packed_micro_batch([5, 9, 3, 1], seed=1, temperature=temperature)
    theirs = scored(base, "torch", batch)
    ours = scored(base, backend, batch)
    assert theirs.keys() == ours.keys()
    assert ours["log_probs"].shape == (18,)  # the packed tokens, total_nnz
    assert bool((ours["log_probs"] < 0).all()) and bool((ours["entropy"] > 0).all())
    head = {"log_probs", "entropy", "grad:lm_head.weight"}  # the head's own: elementwise
    for key in ours:
        check = assert_fp32_close if key in head else assert_body_grad_close
        check(ours[key], theirs[key], key)
    # The head's gradient is not zero: the comparison above could not pass vacuously.
    assert float(ours["grad:lm_head.weight"].abs().max()) > 1e-3


def test_fusedhead_uses_the_engines_shift_labels_verbatim() -> None:
    """The engine's globally rolled labels are scored, not a local re-roll of input_ids."""
    base = tiny_qwen2(0)
    model = base
    ids = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(3))
    shifted = torch.roll(ids, -1, dims=-1)
    shifted[0, -1] = (ids[0, 0] + 1) % 300  # differs from torch.roll(input_ids) at the end
    with restored_verl_patches(type(model)), torch.no_grad():
        apply_verl_monkey_patch(model, "fusedhead:torch")
        out = model(input_ids=ids, shift_labels=shifted, temperature=1.0, return_dict=True)
        hidden = model.model(input_ids=ids)[0]
        shifted_ignored = shifted.clone()
        shifted_ignored[0, 2] = -100
        ignored = model(input_ids=ids, shift_labels=shifted_ignored, return_dict=True)
    logits = (hidden.double() @ model.lm_head.weight.double().T).log_softmax(-1)
    expected = logits.gather(-1, shifted.unsqueeze(-1)).squeeze(-1).float()
    torch.testing.assert_close(out.log_probs, expected, atol=1e-6, rtol=0)
    # -100 scores 0 (verl's own kernel would index out of range); the other rows are unchanged.
    assert float(ignored.log_probs[0, 2]) == 0.0 and float(ignored.entropy[0, 2]) == 0.0
    keep = torch.arange(6) != 2
    torch.testing.assert_close(ignored.log_probs[0, keep], expected[0, keep], atol=1e-6, rtol=0)


def test_a_misspelt_fusedhead_name_raises_instead_of_verls_silent_skip() -> None:
    model = tiny_qwen2(0)
    forward = type(model).forward
    with restored_verl_patches(type(model)):
        for typo in ("fusedhaed:torch", "fused-head:triton", "fused_head"):
            with pytest.raises(ValueError, match=f"'{typo}' is not a fused-kernel backend") as info:
                apply_verl_monkey_patch(model, typo)
            assert "'fusedhead:torch'" in str(info.value) and "'liger'" in str(info.value)
        with pytest.raises(UnknownBackendError, match="no-such-backend"):
            apply_verl_monkey_patch(model, "fusedhead:no-such-backend")
        with pytest.raises(ValueError, match="not one of the accepted forms"):
            apply_verl_monkey_patch(model, "fusedhead:")
        assert type(model).forward is forward  # nothing was patched on the way


def test_a_value_not_meant_for_fusedhead_is_verls_to_handle_as_without_fusedhead() -> None:
    """Installing fusedhead changes nothing for a config that does not name it: verl's own
    silent skip of a name it does not know, with the patch as with verl's original function."""
    from verl.models.transformers import monkey_patch

    assert fh_verl.is_installed()
    model = tiny_qwen2(0)
    forward = type(model).forward
    for value in ("tritonn", "", None):
        with restored_verl_patches(type(model)):
            monkey_patch.patch_forward_with_backends(model, True, value)  # no error: verl's skip
            assert type(model).forward is forward


def test_a_fusedhead_backend_with_fused_kernels_off_raises() -> None:
    from verl.models.transformers import monkey_patch

    model = tiny_qwen2(0)
    with pytest.raises(ValueError, match="use_fused_kernels=False"):
        monkey_patch.patch_forward_with_backends(
            model, use_fused_kernels=False, fused_kernels_backend="fusedhead:torch"
        )
    # verl's own default (fused kernels off, impl_backend torch) is left to verl: no patch.
    forward = type(model).forward
    monkey_patch.patch_forward_with_backends(
        model, use_fused_kernels=False, fused_kernels_backend="torch"
    )
    assert type(model).forward is forward


def test_verls_own_backends_still_go_to_verl() -> None:
    from verl.models.transformers.dense_common import forward_with_torch_backend

    model = tiny_qwen2(0)
    with restored_verl_patches(type(model)):
        apply_verl_monkey_patch(model, "torch")
        assert type(model).forward is forward_with_torch_backend
        assert not hasattr(model, "_fusedhead_head")


def test_a_multimodal_model_type_is_refused() -> None:
    model = tiny_qwen2(0)
    model.config.model_type = "qwen2_vl"
    forward = type(model).forward
    with pytest.raises(ValueError, match="qwen2_vl"):
        fh_verl.patch_forward_with_backends(model, True, "fusedhead:torch")
    assert type(model).forward is forward


def test_the_resolution_hook_reports_provenance_when_verl_patches_the_model() -> None:
    from fusedhead import refresh as clear_cache
    from fusedhead.hooks import hookimpl, register_hooks, unregister_hooks

    seen: list[dict[str, Any]] = []

    class Recorder:
        @hookimpl
        def fusedhead_backend_resolved(
            self, name: str, distribution: str | None, version: str | None, **_: Any
        ) -> None:
            seen.append({"name": name, "distribution": distribution, "version": version})

    recorder = Recorder()
    register_hooks(recorder)
    clear_cache()
    model = tiny_qwen2(0)
    try:
        with restored_verl_patches(type(model)):
            apply_verl_monkey_patch(model, "fusedhead:torch")
    finally:
        unregister_hooks(recorder)
        clear_cache()
    assert seen and seen[-1]["name"] == "torch"
    assert seen[-1]["distribution"] == "fusedhead-torch"


def test_calculate_entropy_off_reads_only_log_probs() -> None:
    base = tiny_qwen2(0)
    batch = packed_micro_batch([4, 7], seed=2, entropy=False)
    from verl_helpers import engine

    with restored_verl_patches(type(base)):
        apply_verl_monkey_patch(base, "fusedhead:torch")
        eng = engine()
        inputs, args = eng.prepare_model_inputs(batch)
        result = eng.prepare_model_outputs(base(**inputs), args, batch, None)
    assert "entropy" not in result and result["log_probs"].values().shape == (11,)


#: Seconds the two ranks get before the test fails as a hang.
TIMEOUT_S = 300


def _spawn(scenarios: list[str], tmp_path: Path, world: int = 2) -> None:
    from verl_fsdp_worker import worker

    args = (world, f"file://{tmp_path / 'rendezvous'}", scenarios, str(tmp_path))
    run_ranks(worker, args, world, tmp_path, str(scenarios), TIMEOUT_S)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_under_verls_apply_fsdp2_on_two_gloo_ranks(tmp_path: Path) -> None:
    """fusedhead matches the unsharded model where verl's own torch path reads a DTensor."""
    _spawn(["fusedhead_matches_unsharded", "verl_torch_path_reads_a_dtensor"], tmp_path)
    for log in sorted(tmp_path.glob("rank*.log")):
        text = log.read_text()
        assert "fusedhead under apply_fsdp2 matches the unsharded model" in text
        assert "failed as in verl #5633" in text


def _doc_blocks(name: str) -> list[str]:
    import re

    text = (HERE.parents[1] / "docs" / "integrations" / name).read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_docs_example_runs(tmp_path: Path) -> None:
    """docs/integrations/verl.md's example (skipped by the docs test without verl) runs here."""
    (block,) = _doc_blocks("verl.md")
    script = tmp_path / "example.py"
    script.write_text(block)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Only fusedhead's forward takes shift_labels and returns log_probs: the entry point loaded.
    assert "torch.Size([1, 12]) torch.Size([1, 12])" in done.stdout
    assert "'fusedhaed:torch' is not a fused-kernel backend" in done.stdout


def test_uninstall_gives_verl_its_function_back_and_install_is_idempotent() -> None:
    from verl.models.transformers import monkey_patch

    assert fh_verl.is_installed()  # import verl loaded the entry point in this process
    fh_verl.uninstall()
    try:
        assert monkey_patch.patch_forward_with_backends is not fh_verl.patch_forward_with_backends
        assert not fh_verl.is_installed()
        model = tiny_qwen2(0)
        forward = type(model).forward
        monkey_patch.patch_forward_with_backends(model, True, "tritonn")  # verl's silent skip
        assert type(model).forward is forward
    finally:
        fh_verl.install()
        fh_verl.install()
    assert monkey_patch.patch_forward_with_backends is fh_verl.patch_forward_with_backends


def _trl_without_value_head() -> None:
    """Skip unless TRL is installed without the value-head class verl 0.9.1 probes for."""
    pytest.importorskip("trl", reason="TRL is not installed (bash scripts/trainers/trl.sh)")
    if fh_verl.trl_has_value_head():
        pytest.skip("this TRL still has AutoModelForCausalLMWithValueHead: verl's probe works")


def test_apply_monkey_patch_beside_trl_116_works_with_the_opt_in_fix() -> None:
    """verl's real probe, TRL installed: ImportError without the fix, fusedhead's forward with it."""
    _trl_without_value_head()
    from transformers.integrations import flash_attention
    from verl.models.transformers import monkey_patch
    from verl.utils.import_utils import is_trl_available

    model = tiny_qwen2(0)
    forward, fa = type(model).__dict__["forward"], flash_attention._flash_attention_forward
    try:
        fh_verl.fix_trl_value_head_probe(False)
        assert monkey_patch.is_trl_available is is_trl_available  # verl's own probe
        with pytest.raises(ImportError, match="AutoModelForCausalLMWithValueHead"):
            apply_verl_monkey_patch(model, "fusedhead:torch")
        fh_verl.fix_trl_value_head_probe()
        assert is_trl_available()  # verl still sees TRL; only the class probe is narrowed
        assert monkey_patch.is_trl_available is fh_verl.trl_has_value_head
        apply_verl_monkey_patch(model, "fusedhead:torch")
        assert type(model).forward is fh_verl.forward_with_fusedhead_backend
        with pytest.raises(TypeError, match="enable must be a bool"):
            fh_verl.fix_trl_value_head_probe("yes")  # type: ignore[arg-type]
    finally:
        fh_verl.fix_trl_value_head_probe(False)
        type(model).forward = forward
        flash_attention._flash_attention_forward = fa
    assert monkey_patch.is_trl_available is is_trl_available


def test_the_trl_probe_fix_from_the_environment_in_a_fresh_process() -> None:
    """FUSEDHEAD_VERL_FIX_TRL_PROBE=1 (verl's Ray workers) applies the fix on ``import verl``."""
    _trl_without_value_head()
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
        "import verl\n"
        "from verl_helpers import apply_verl_monkey_patch, tiny_qwen2\n"
        "model = tiny_qwen2(0)\n"
        "apply_verl_monkey_patch(model, 'fusedhead:torch')\n"
        "print('forward', type(model).forward.__name__)\n"
    )
    done = _python(code, FUSEDHEAD_VERL_FIX_TRL_PROBE="1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "forward forward_with_fusedhead_backend" in done.stdout
    failed = _python(code, FUSEDHEAD_VERL_FIX_TRL_PROBE="false")  # off, as "0" is
    assert failed.returncode != 0 and "AutoModelForCausalLMWithValueHead" in failed.stderr
    # neither: a warning names it (verl's loader would swallow an error) and the fix stays off
    typo = _python(code, FUSEDHEAD_VERL_FIX_TRL_PROBE="maybe")
    assert "FUSEDHEAD_VERL_FIX_TRL_PROBE='maybe' is not an on/off value" in typo.stderr
    assert typo.returncode != 0 and "AutoModelForCausalLMWithValueHead" in typo.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_backend_that_cannot_run_on_verls_device_fails_at_model_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fusedhead.errors import BackendUnavailableError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_qwen2(0)
    forward = type(model).__dict__["forward"]
    with pytest.raises(BackendUnavailableError) as err:
        fh_verl.patch_forward_with_backends(model, True, "fusedhead:triton")
    text = str(err.value)
    # the value as the user wrote it in verl's config, not fusedhead's name for the backend
    assert "fused_kernel_options.impl_backend='fusedhead:triton'" in text
    assert "device (cpu, in any of the dtypes it declares" in text  # no dtype made up
    assert "Fix:" in text and "'fusedhead:torch'" in text
    assert type(model).__dict__["forward"] is forward  # nothing patched


IMPL_BACKEND = "actor_rollout_ref.model.fused_kernel_options.impl_backend"


@pytest.mark.parametrize(
    ("spec", "error", "words"),
    [
        ("fusedhead:nosuch", "UnknownBackendError", "names no installed fusedhead backend"),
        ("FusedHead:torch", "ValueError", "is not one of the accepted forms"),
        ("fusedhead:", "ValueError", "is not one of the accepted forms"),
        ("fusedhead:bad name", "ValueError", "is not one of the accepted forms"),
    ],
)
def test_a_bad_fusedhead_name_is_reported_as_verls_setting(
    spec: str, error: str, words: str
) -> None:
    """Unknown and malformed names are the value of verl's setting, echoed as written."""
    from fusedhead.integrations.lm_head import installed_backend_names

    model = tiny_qwen2(0)
    with pytest.raises(Exception) as err:
        fh_verl.patch_forward_with_backends(model, True, spec)
    assert type(err.value).__name__ == error
    text = str(err.value)
    assert f"{IMPL_BACKEND}={spec!r} {words}" in text, text
    assert "backend spec" not in text
    if error == "UnknownBackendError":  # the fix, in the setting's own spelling
        names = ", ".join(f"'fusedhead:{n}'" for n in installed_backend_names())
        assert f"Fix: set {IMPL_BACKEND} to one of {names}" in text, text


def test_an_unavailable_backend_is_reported_in_verls_terms() -> None:
    """A backend that cannot run on verl's device: the value as written, fixes verl's config can
    express (another fusedhead:<name>; no backend options through verl), and outside verl's
    engine, where the dtype is not known, no dtype claimed as the model's."""
    from backend_stubs import gpu_only_backend

    from fusedhead.errors import BackendUnavailableError

    model = tiny_qwen2(0)
    with gpu_only_backend() as checked, pytest.raises(BackendUnavailableError) as err:
        fh_verl.patch_forward_with_backends(model, True, "fusedhead:gpu-only-test")
    text = str(err.value)
    assert f"{IMPL_BACKEND}='fusedhead:gpu-only-test' cannot run on this trainer's device" in text
    assert "impl_backend='gpu-only-test'" not in text
    assert checked[0] == torch.bfloat16  # the only dtype it declares, and the message says so
    assert (
        "(cpu; the dtype is not known here, so it was checked with torch.bfloat16, the only "
        "dtype it declares)" in text
    )
    fix = err.value.hint or ""
    assert fix.startswith(f"set {IMPL_BACKEND} to a backend that runs on cpu here: ")
    assert "'fusedhead:torch'" in fix and "'fusedhead:gpu-only-test'" not in fix
    assert f"{IMPL_BACKEND} takes a backend's name only, not its options" in fix


def test_a_models_logit_scale_is_applied_as_its_own_logits_apply_it() -> None:
    """Granite divides its logits by logits_scaling; verl's own fused kernels, and fusedhead's
    verl forward with them, dropped it (log-probs of other logits, without a word). The same
    model with the scale folded into its head weight is the reference."""
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    config = GraniteConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, logits_scaling=4.0,
    )  # fmt: skip
    scaled = GraniteForCausalLM(config).float()
    with torch.no_grad():
        scaled.lm_head.weight.mul_(8.0)  # logits large enough that the scale matters
    folded = copy.deepcopy(scaled)
    folded.config.logits_scaling = 1.0
    with torch.no_grad():
        folded.lm_head.weight.div_(4.0)
    batch = packed_micro_batch([5, 9, 3], seed=1, temperature=0.7)
    ours = scored(scaled, "fusedhead:torch", batch)
    want = scored(folded, "torch", batch)  # verl's own path, on a model with nothing to drop
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(ours[key], want[key], rtol=1e-5, atol=1e-5)
    dropped = scored(scaled, "torch", batch)["log_probs"]  # verl's own kernels drop the scale
    assert float((dropped - want["log_probs"]).abs().max()) > 1e-2
