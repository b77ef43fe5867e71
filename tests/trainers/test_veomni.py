"""fusedhead inside VeOmni 0.1.12: ``cross_entropy_loss_implementation: fusedhead:<name>``.

Models are built by VeOmni's own ``build_foundation_model`` from an ``OpsImplementationConfig``,
so the kernel is found through VeOmni's ``KERNEL_REGISTRY`` and bound into the OpSlot of its
generated Qwen2 code; the reference is the same model built with VeOmni's ``chunk_loss``
(whose log-probs path is ``chunk_logprobs_function``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("veomni", reason="VeOmni is not installed (bash scripts/trainers/veomni.sh)")

from veomni_helpers import (
    IGNORE,
    VOCAB,
    assert_fp32_close,
    build,
    packed_batch,
    padded_batch,
    run,
    veomni_state,
)

import fusedhead
from fusedhead.errors import UnknownBackendError
from fusedhead.integrations import veomni as fh_veomni


@pytest.fixture(autouse=True)
def _installed() -> Iterator[None]:
    with veomni_state():
        yield


def _slot(model: Any) -> Any:
    return sys.modules[type(model).__module__].veomni_causal_lm_loss


def _compare(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert_fp32_close(ours[key], theirs[key], key)
    assert float(ours["grad:lm_head.weight"].abs().max()) > 1e-4  # not vacuous


def test_install_registers_a_kernel_per_installed_backend() -> None:
    from veomni.ops.kernel_registry import KERNEL_REGISTRY

    from fusedhead import diagnostics

    names = {row.name for row in diagnostics.listing()}
    for variant in ("causal", "seq_cls"):
        available = set(KERNEL_REGISTRY.list_available("cross_entropy_loss", variant))
        assert {f"fusedhead:{n}" for n in names} <= available, variant
    assert fh_veomni.register() == []  # idempotent
    assert fh_veomni.is_installed()


def test_build_foundation_model_resolves_the_registered_kernel_by_name() -> None:
    from transformers.loss.loss_utils import LOSS_MAPPING

    from fusedhead.hooks import hookimpl, register_hooks, unregister_hooks

    seen: list[str] = []

    class Recorder:
        @hookimpl
        def fusedhead_backend_resolved(self, name: str, **_: Any) -> None:
            seen.append(name)

    recorder = Recorder()
    register_hooks(recorder)
    try:
        model = build("fusedhead:torch")
    finally:
        unregister_hooks(recorder)
    slot = _slot(model)
    assert slot.use_non_eager_impl and slot._impl_name == "fusedhead:torch"
    kernel = slot.bound_kernel()
    assert kernel.func is fh_veomni.fusedhead_causal_lm_loss
    assert kernel.keywords["head"].config.backend == "torch"
    entry = LOSS_MAPPING["ForCausalLM"]
    assert entry.loss.func is fh_veomni.fusedhead_causal_lm_loss
    # VeOmni's ops summary prints the entry's name: "cross_entropy = unset" for a partial
    from veomni.ops import _current_cross_entropy_name

    assert _current_cross_entropy_name() == "fusedhead:torch"
    assert seen and seen[0] == "torch"  # provenance, reported while VeOmni built the model


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    """The same weights twice; the second build rebinds the (module-global) slot, so each test
    rebinds it to the model it runs (see :func:`_bind`)."""
    with veomni_state():
        theirs = build("chunk_loss")
        ours = build("fusedhead:torch", theirs.state_dict())
    return theirs, ours


def _bind(model: Any, impl: str) -> Any:
    _slot(model).bind(impl)
    return model


def test_packed_batch_loss_with_shift_labels_matches_chunk_loss(models: tuple[Any, Any]) -> None:
    theirs, ours = models
    batch = packed_batch([6, 9, 4], seed=1)
    expected = run(_bind(theirs, "chunk_loss"), batch)
    got = run(_bind(ours, "fusedhead:torch"), batch)
    _compare(got, expected)


@pytest.mark.parametrize("impl", ["fusedhead:torch", "fusedhead:triton"])
def test_packed_batch_log_probs_with_shift_labels_match_chunk_logprobs(
    models: tuple[Any, Any], impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fusedhead:triton`` runs its kernels under the Triton interpreter on the CPU (set here,
    as tests/triton_backend does, so a CUDA machine runs it the same way)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    theirs, ours = models
    batch = packed_batch([6, 9, 4], seed=2)
    kwargs = {"return_log_probs": True, "temperature": 0.7}
    expected = run(_bind(theirs, "chunk_loss"), batch, **kwargs)
    got = run(_bind(ours, impl), batch, **kwargs)
    _compare(got, expected)
    # shift_labels verbatim: ignored targets give 0, and the output has the labels' shape.
    ignored = batch["shift_labels"] == IGNORE
    assert got["log_probs"].shape == (1, 19)
    assert bool((got["log_probs"][ignored] == 0).all()) and bool(
        (got["log_probs"][~ignored] < 0).all()
    )


def test_a_loss_over_num_items_in_batch_is_veomnis_eager_loss(models: tuple[Any, Any]) -> None:
    """With ``num_items_in_batch`` (a global token count) the kernel's loss is VeOmni's eager
    ``ForCausalLMLoss``: the sum over that count. (``chunk_loss`` gives another value there; its
    own trainer passes no count.)"""
    theirs, ours = models
    batch = packed_batch([6, 9, 4], seed=4)
    kwargs = {"num_items_in_batch": torch.tensor(123)}
    with veomni_state():  # the eager loss is VeOmni's mapping while its build's state holds
        expected = run(build("eager", theirs.state_dict()), batch, **kwargs)
    got = run(_bind(ours, "fusedhead:torch"), batch, **kwargs)
    _compare(got, expected)
    mean = run(_bind(ours, "fusedhead:torch"), batch)["loss"]  # the count is not ignored
    assert not torch.allclose(got["loss"], mean)


@pytest.mark.parametrize("log_probs", [False, True], ids=["loss", "log_probs"])
def test_padded_batch_matches_chunk_loss(models: tuple[Any, Any], log_probs: bool) -> None:
    theirs, ours = models
    batch = padded_batch([8, 5, 2], width=8, seed=3)
    kwargs = {"return_log_probs": True} if log_probs else {}
    expected = run(_bind(theirs, "chunk_loss"), batch, **kwargs)
    got = run(_bind(ours, "fusedhead:torch"), batch, **kwargs)
    _compare(got, expected)
    if log_probs:  # the causal shift: the last slot and padding give 0
        assert bool((got["log_probs"][:, -1] == 0).all())
        assert bool((got["log_probs"][2, 1:] == 0).all())


def test_an_unknown_fusedhead_name_fails_the_build_loudly() -> None:
    with pytest.raises(UnknownBackendError, match="no-such-backend"):
        build("fusedhead:no-such-backend")
    with pytest.raises(ValueError, match="not one of the accepted forms"):
        build("fusedhead:")


def test_a_backend_that_cannot_run_here_fails_where_the_config_is_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: accepted at the build, refused at the first forward without naming the setting."""
    from veomni.ops.kernels import cross_entropy

    from fusedhead.errors import BackendUnavailableError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CPU: triton cannot run
    fusedhead.refresh()
    with pytest.raises(BackendUnavailableError, match="cross_entropy_loss_implementation") as info:
        cross_entropy.install_loss_mapping("fusedhead:triton")
    text = str(info.value)
    assert "cross_entropy_loss_implementation='fusedhead:triton' cannot run" in text
    assert "this trainer's device (cpu, in any of the dtypes it declares" in text


SETTING = "cross_entropy_loss_implementation"


@pytest.mark.parametrize(
    ("spec", "error", "words"),
    [
        ("fusedhead:no-such-backend", UnknownBackendError, "names no installed fusedhead backend"),
        ("FusedHead:torch", ValueError, "is not one of the accepted forms"),
        ("fusedhead:", ValueError, "is not one of the accepted forms"),
    ],
)
def test_a_bad_fusedhead_name_is_reported_as_veomnis_setting(
    spec: str, error: type[Exception], words: str
) -> None:
    from veomni.ops.kernels import cross_entropy

    with pytest.raises(error) as err:
        cross_entropy.install_loss_mapping(spec)
    text = str(err.value)
    assert f"{SETTING}={spec!r} {words}" in text, text
    assert "backend spec" not in text


def test_an_unavailable_backend_is_reported_in_veomnis_terms() -> None:
    """The value as written, the fix VeOmni's config can express (another fusedhead:<name>),
    the backend's Python-side advice (options=) said to be out of this setting's reach, and the
    dtype said to be unknown where VeOmni applies the config, not claimed as the model's."""
    from backend_stubs import gpu_only_backend
    from veomni.ops.kernels import cross_entropy

    from fusedhead.errors import BackendUnavailableError

    with gpu_only_backend(), pytest.raises(BackendUnavailableError) as err:
        cross_entropy.install_loss_mapping("fusedhead:gpu-only-test")
    text = str(err.value)
    assert (
        f"{SETTING}='fusedhead:gpu-only-test' cannot run on this trainer's device (cpu; the "
        "dtype is not known here, so it was checked with torch.bfloat16" in text
    )
    fix = err.value.hint or ""
    assert fix.startswith(f"set {SETTING} to a backend that runs on cpu here: ")
    assert "'fusedhead:torch'" in fix
    assert f"{SETTING} takes a backend's name only, not its options" in fix


def test_a_misspelt_fusedhead_name_lists_fusedheads_names() -> None:
    from veomni.ops.kernels import cross_entropy

    with pytest.raises(ValueError, match=r"looks meant for fusedhead.*'fusedhead:torch'"):
        cross_entropy.install_loss_mapping("fusedhaed:torch")


def test_veomni_names_still_go_to_veomni() -> None:
    from veomni.ops.kernels import cross_entropy

    assert cross_entropy.install_loss_mapping("eager") == "CrossEntropy (eager)"
    with pytest.raises(ValueError, match="Unknown cross_entropy_loss_implementation: 'bogus'"):
        cross_entropy.install_loss_mapping("bogus")


def _teacher(shape: tuple[int, ...], k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher's top-k ids and log-probs per position (spread so a clamp at -5.5 bites)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack(
        [torch.randperm(VOCAB, generator=gen)[:k] for _ in range(shape[0] * shape[1])]
    )
    log_probs = torch.log_softmax(torch.randn(shape[0] * shape[1], k, generator=gen) * 3, -1) - 0.2
    return ids.reshape(*shape, k), log_probs.reshape(*shape, k)


def _distill(model: Any, batch: dict[str, torch.Tensor], **kwargs: Any) -> dict[str, torch.Tensor]:
    """The five aux outputs of the top-k distillation path and every gradient of a loss on them."""
    aux = model(**batch, return_log_probs=True, **kwargs).fused_linear_aux
    loss = aux.distillation_losses.sum() + 0.5 * aux.log_probs.sum() + 0.3 * aux.entropy.sum()
    loss.backward()
    names = ("log_probs", "entropy", "distillation_losses", "student_mass", "teacher_mass")
    result = {name: getattr(aux, name).detach() for name in names}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        result[f"grad:{name}"] = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    return result


@pytest.mark.parametrize(
    ("impl", "layout", "clamp"),
    [
        ("fusedhead:torch", "packed", None),
        ("fusedhead:torch", "packed", -5.5),
        ("fusedhead:torch", "padded", -5.5),
        ("fusedhead:triton", "packed", -5.5),
    ],
)
def test_top_k_distillation_matches_chunk_topk_distill(
    models: tuple[Any, Any],
    impl: str,
    layout: str,
    clamp: float | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """verl's VeOmni engine passes teacher_topk_ids / teacher_topk_log_probs for top-k
    distillation; the outputs and gradients are those of VeOmni's chunk_topk_distill_function
    (packed with shift_labels, padded with VeOmni's causal shift, with and without
    log_prob_min_clamp)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    theirs, ours = models
    if layout == "packed":
        batch = packed_batch([6, 9, 4], seed=4)
    else:
        batch = padded_batch([8, 5, 2], width=8, seed=4)
    ids, log_probs = _teacher(tuple(batch["input_ids"].shape), 5, seed=5)
    kwargs: dict[str, Any] = {
        "temperature": 0.7,
        "teacher_topk_ids": ids,
        "teacher_topk_log_probs": log_probs,
        "log_prob_min_clamp": clamp,
    }
    expected = _distill(_bind(theirs, "chunk_loss"), batch, **kwargs)
    got = _distill(_bind(ours, impl), batch, **kwargs)
    _compare(got, expected)
    assert float(got["distillation_losses"].abs().max()) > 0.1  # not vacuous
    if clamp is not None:  # the clamp changed the loss
        unclamped = _distill(ours, batch, **{**kwargs, "log_prob_min_clamp": None})
        diff = (unclamped["distillation_losses"] - got["distillation_losses"]).abs().max()
        assert float(diff) > 1e-3


def test_top_k_distillation_needs_both_teacher_tensors(models: tuple[Any, Any]) -> None:
    _, ours = models
    batch = packed_batch([4, 4], seed=4)
    ids = torch.zeros(1, 8, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="must be provided together"):
        _bind(ours, "fusedhead:torch")(**batch, return_log_probs=True, teacher_topk_ids=ids)


def test_nothing_is_patched_until_install_is_called() -> None:
    code = (
        "import sys\n"
        "import fusedhead.integrations.veomni as fv\n"
        "print('OUT', sorted(m for m in ('torch', 'veomni') if m in sys.modules))\n"
        "from veomni.ops.kernels import cross_entropy\n"
        "try:\n"
        "    cross_entropy.install_loss_mapping('fusedhead:torch')\n"
        "except ValueError as e:\n"
        "    print('OUT', 'Unknown cross_entropy_loss_implementation' in str(e))\n"
        "fv.install()\n"
        "print('OUT', cross_entropy.install_loss_mapping('fusedhead:torch'))\n"
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
    assert lines == ["OUT []", "OUT True", "OUT CrossEntropy (fusedhead:torch)"]


def test_the_docs_example_runs(tmp_path: Any) -> None:
    """docs/integrations/veomni.md's example (skipped by the docs test without VeOmni) runs here."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "integrations" / "veomni.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, re.S)
    script = tmp_path / "example.py"
    script.write_text(block)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch.Size([1, 12]) torch.Size([1, 12])" in done.stdout


def _kernel() -> Any:
    """fusedhead's VeOmni kernel on the torch backend, as VeOmni's registry resolves it."""
    from fusedhead.integrations.backend_spec import resolve_lm_head

    return lambda **kw: fh_veomni.fusedhead_causal_lm_loss(
        head=resolve_lm_head("fusedhead:torch"), **kw
    )


def test_top_k_slots_padded_with_ignore_index_add_nothing() -> None:
    """A row with fewer than k teacher ids, padded with ignore_index (VeOmni refuses such ids):
    the padded slot's gathered 0 was counted as a probability of 1 in student_mass, and its -inf
    teacher value made the KL NaN. Now the padded call equals the unpadded one on the k - 1 real
    slots."""
    torch.manual_seed(0)
    h, w = torch.randn(1, 5, 16), torch.randn(40, 16) * 0.3
    labels = torch.randint(0, 40, (1, 5))
    ids = torch.randint(0, 40, (1, 5, 3))
    teacher = torch.log_softmax(torch.randn(1, 5, 3), -1)
    pad_ids = torch.cat([ids, torch.full((1, 5, 1), IGNORE)], -1)
    pad_teacher = torch.cat([teacher, torch.full((1, 5, 1), float("-inf"))], -1)
    kernel = _kernel()
    common = {"hidden_states": h, "weights": w, "shift_labels": labels, "return_log_probs": True}
    want = kernel(**common, teacher_topk_ids=ids, teacher_topk_log_probs=teacher)[2]
    got = kernel(**common, teacher_topk_ids=pad_ids, teacher_topk_log_probs=pad_teacher)[2]
    for field in ("distillation_losses", "student_mass", "teacher_mass"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=0, atol=1e-6)
    assert torch.isfinite(got.distillation_losses).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"labels": "float"}, TypeError, "^labels must be an integer tensor"),
        ({"labels": "bool"}, TypeError, "^labels must be an integer tensor"),
        ({"temperature": "0.7"}, TypeError, "temperature"),
        ({"temperature": True}, TypeError, "temperature"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"ignore_index": "x"}, TypeError, "^ignore_index must be an int"),
        ({"log_prob_min_clamp": "x"}, TypeError, "^log_prob_min_clamp must be a number"),
        ({"teacher_k": 3}, ValueError, r"^teacher_topk_log_probs of shape \(2, 7, 3\) must match"),
    ],
)
def test_bad_kernel_arguments_are_named(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    """Each was truncated (a float label), accepted (a str or bool temperature) or failed inside
    torch without naming the argument."""
    torch.manual_seed(0)
    h, w = torch.randn(2, 7, 16), torch.randn(50, 16)
    labels = torch.randint(0, 50, (2, 7))
    ids = torch.randint(0, 50, (2, 7, 5))
    teacher = torch.log_softmax(torch.randn(2, 7, 5), -1)
    call: dict[str, Any] = {"hidden_states": h, "weights": w, "labels": labels}
    if kwargs.get("labels") in ("float", "bool"):
        call["labels"] = labels.float() if kwargs["labels"] == "float" else labels > 0
    elif "teacher_k" in kwargs:
        call.update(return_log_probs=True, teacher_topk_ids=ids)
        call["teacher_topk_log_probs"] = teacher[..., : kwargs["teacher_k"]]
    elif "log_prob_min_clamp" in kwargs:
        call.update(return_log_probs=True, teacher_topk_ids=ids, teacher_topk_log_probs=teacher)
        call.update(kwargs)
    else:
        call.update(return_log_probs="temperature" in kwargs, **kwargs)
    with pytest.raises(error, match=match):
        _kernel()(**call)


def test_register_takes_a_list_of_names() -> None:
    with pytest.raises(TypeError, match="a list of backend names, got the str 'torch'"):
        fh_veomni.register("torch")  # type: ignore[arg-type]
    for bad in ("Torch", "fusedhead:torch"):
        with pytest.raises(ValueError, match=f"names: '{bad}' is not a backend name"):
            fh_veomni.register([bad])


def test_uninstall_puts_back_the_loss_mapping() -> None:
    """A plain transformers model's loss after uninstall() is transformers' again (it raised
    "fusedhead's VeOmni kernel needs hidden_states=")."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    before = dict(LOSS_MAPPING)
    from veomni.ops.kernels import cross_entropy

    cross_entropy.install_loss_mapping("fusedhead:torch")
    assert LOSS_MAPPING["ForCausalLM"] is not before["ForCausalLM"]
    fh_veomni.uninstall()
    assert LOSS_MAPPING["ForCausalLM"] is before["ForCausalLM"]
    assert LOSS_MAPPING.get("ForSequenceClassification") is before.get("ForSequenceClassification")
    # An entry VeOmni set after fusedhead's (another model built with its eager kernel) is
    # VeOmni's to keep: uninstall() put transformers' stock loss back over it, which broke it.
    fh_veomni.install()
    cross_entropy.install_loss_mapping("fusedhead:torch")
    cross_entropy.install_loss_mapping("eager")
    eager = LOSS_MAPPING["ForCausalLM"]
    fh_veomni.uninstall()
    assert LOSS_MAPPING["ForCausalLM"] is eager
    fh_veomni.install()  # as the fixture left it


def test_the_loss_path_ignores_the_teacher_as_veomni_does() -> None:
    torch.manual_seed(0)
    h, w = torch.randn(1, 5, 16), torch.randn(40, 16)
    labels = torch.randint(0, 40, (1, 5))
    loss, _, _ = _kernel()(
        hidden_states=h, weights=w, labels=labels, teacher_topk_ids=torch.zeros(1, 5, 2),
        teacher_topk_log_probs="unused", log_prob_min_clamp="unused",
    )  # fmt: skip
    assert torch.isfinite(loss)
