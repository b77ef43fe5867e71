"""``implementation="native"`` (the default) runs Liger's SM90 kernel or stops with a clear error.

On a CPU machine every path here ends in ``BackendUnavailableError`` naming the reason and the
ways out; GPU properties are simulated by patching torch.cuda so each reason is seen on its own.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from typing import ClassVar

import pydantic
import pytest
import torch

from fusedhead import registry
from fusedhead.errors import BackendUnavailableError
from fusedhead.protocol import call_backend

pytest.importorskip(
    "fusedhead_liger",
    reason="the liger backend is not installed (pip install ./plugins/liger_backend)",
)
from fusedhead_liger import LigerBackend, LigerOptions, _liger, availability

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def small():
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(4, 8, generator=gen),
        torch.randn(11, 8, generator=gen),
        torch.tensor([1, 2, 3, -100]),
    )


def forward(backend, hidden, weight, labels):
    return call_backend(backend,
        hidden, weight, labels, temperature=1.0, ignore_index=-100, return_entropy=True,
        process_group=None, vocab_start=0, vocab_size=weight.shape[0], reduce_hidden_grad=True,
    )  # fmt: skip


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch):
    """Pretend torch sees a CUDA GPU of a chosen compute capability."""

    def set_gpu(capability: tuple[int, int], name: str = "NVIDIA H200") -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.version, "hip", None)

    return set_gpu


def test_default_is_native() -> None:
    assert LigerBackend().implementation == "native"
    assert LigerBackend(LigerOptions()).options.implementation == "native"


def test_options_forbid_unknown_fields_and_values() -> None:
    with pytest.raises(pydantic.ValidationError):
        LigerOptions(implementation="auto")
    with pytest.raises(pydantic.ValidationError):
        LigerOptions(chunk_size=512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_on_cpu_says_why_and_how_to_fix(dtype: torch.dtype) -> None:
    with pytest.raises(BackendUnavailableError) as info:
        LigerBackend().check(CPU, dtype)
    msg = str(info.value)
    assert "not a CUDA GPU" in msg
    assert '{"implementation": "fallback"}' in msg
    # another backend is offered, one that runs here: not triton, which needs CUDA too
    assert 'another backend (e.g. backend="torch")' in msg and 'backend="triton"' not in msg
    assert ("bfloat16 only" in msg) == (dtype != torch.bfloat16)


def test_forward_on_cpu_raises_before_touching_liger() -> None:
    with pytest.raises(BackendUnavailableError, match="implementation"):
        forward(LigerBackend(), *small())


def test_h200_without_the_cute_dsl(fake_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu((9, 0))
    monkeypatch.setattr(_liger, "cute_dsl_installed", lambda: False)
    with pytest.raises(BackendUnavailableError) as info:
        LigerBackend().check(CUDA, torch.bfloat16)
    msg = str(info.value)
    assert "CuTe DSL (nvidia-cutlass-dsl) is not installed" in msg
    assert "fusedhead-liger[sm90]" in msg and "nvidia-cutlass-dsl[cu13]==4.8.1" in msg
    assert "compute capability" not in msg


def test_h200_fp32_is_our_error_not_ligers_type_error(
    fake_gpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpu((9, 0))
    monkeypatch.setattr(_liger, "cute_dsl_installed", lambda: True)
    monkeypatch.setattr(_liger, "native_import_error", lambda: None)
    backend = LigerBackend()
    backend.check(CUDA, torch.bfloat16)  # everything in place for bf16
    with pytest.raises(BackendUnavailableError) as info:
        backend.check(CUDA, torch.float32)
    msg = str(info.value)
    assert "torch.float32" in msg and "bfloat16 only" in msg
    assert "pass bfloat16" in msg and "fallback" in msg
    assert "CuTe DSL" not in msg


def test_h200_where_the_dsl_fails_to_import(fake_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu((9, 0))
    monkeypatch.setattr(_liger, "cute_dsl_installed", lambda: True)
    monkeypatch.setattr(
        _liger, "native_import_error", lambda: "RuntimeError: No CTK flavor installed"
    )
    with pytest.raises(BackendUnavailableError, match="No CTK flavor installed"):
        LigerBackend().check(CUDA, torch.bfloat16)


@pytest.mark.parametrize("capability", [(8, 0), (10, 0), (12, 0)])
def test_other_gpus_are_refused_where_liger_would_silently_fall_back(
    fake_gpu, monkeypatch, capability
) -> None:
    fake_gpu(capability, "Some GPU")
    monkeypatch.setattr(_liger, "cute_dsl_installed", lambda: True)
    with pytest.raises(BackendUnavailableError) as info:
        LigerBackend().check(CUDA, torch.bfloat16)
    msg = str(info.value)
    assert f"compute capability {capability[0]}.{capability[1]}" in msg
    assert "silently run its chunked fallback" in msg


def test_describe_says_what_would_run(fake_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    native_cpu = LigerBackend().describe(CPU)
    assert native_cpu["implementation"] == "native" and native_cpu["would_run"] == "no"
    assert "not a CUDA GPU" in native_cpu["reason"]
    assert native_cpu["liger_kernel"] == md.version("liger-kernel")
    assert all(isinstance(v, str) for v in native_cpu.values())
    fallback_cpu = LigerBackend(LigerOptions(implementation="fallback")).describe(
        CPU, torch.float32
    )
    assert fallback_cpu["would_run"] == "yes" and "on purpose" in fallback_cpu["reason"]
    fake_gpu((9, 0))
    monkeypatch.setattr(_liger, "cute_dsl_installed", lambda: True)
    monkeypatch.setattr(_liger, "native_import_error", lambda: None)
    native_h200 = LigerBackend().describe(CUDA)
    assert native_h200["would_run"] == "yes" and "SM90" in native_h200["reason"]


def test_capabilities_are_honest() -> None:
    native = LigerBackend().capabilities(CUDA)
    assert native.devices == ("cuda",) and native.dtypes == ("bf16",)
    assert native.logits_precision == "fp16" and native.entropy_precision == "bf16"
    fallback = LigerBackend(LigerOptions(implementation="fallback")).capabilities(CPU)
    assert set(fallback.devices) == {"cpu", "cuda"} and set(fallback.dtypes) == {
        "fp32",
        "fp16",
        "bf16",
    }
    assert fallback.vocab_parallel and not native.vocab_parallel
    for caps in (native, fallback):
        assert not caps.per_token_temperature and not caps.softcap and not caps.uneven_shards
        assert not caps.deterministic and not caps.batch_invariant


def test_liger_private_functions_are_the_tested_ones() -> None:
    assert md.version("liger-kernel") == _liger.TESTED_LIGER
    assert _liger.fallback_function().__name__ == "_FusedLinearPPOFallbackFunction"
    assert _liger.tp_fallback_function().__name__ == "_TensorParallelFusedLinearPPOFallbackFunction"


def test_entry_point_and_cheap_import() -> None:
    (ep,) = [e for e in md.entry_points(group="fusedhead.backends") if e.name == "liger"]
    assert ep.value == "fusedhead_liger:LigerBackend"
    assert ep.load() is LigerBackend
    code = "import sys, fusedhead_liger; assert 'liger_kernel' not in sys.modules, 'liger imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_install_hint_names_the_extra_and_what_installs_before_pypi() -> None:
    assert "fusedhead-liger[sm90]" in availability.INSTALL_HINT
    # the DSL's own packages are on PyPI today, at the pins the extra holds
    assert "pip install 'nvidia-cutlass-dsl[cu13]==4.8.1' 'apache-tvm-ffi==0.1.15.post2'" in (
        availability.INSTALL_HINT
    )


# ----------------------------------------------------------------------------- through the core


def test_core_default_options_raise_the_clear_error() -> None:
    from fusedhead import api

    registry.refresh()
    with pytest.raises(BackendUnavailableError) as info:
        api.fused_head(*small(), backend="liger")
    assert '{"implementation": "fallback"}' in str(info.value)


# ----------------------------------------------------------------------------- the native plumbing


class FakeSM90:
    """Stands in for Liger's SM90 function on the CPU: same signature, bf16 entropy, records calls."""

    calls: ClassVar[list[dict]] = []

    @classmethod
    def apply(
        cls, hidden, weight, target, temperature, ignore_index, m_tiles_per_cluster, return_entropy
    ):
        cls.calls.append(
            {"target": target.clone(), "m_tiles": m_tiles_per_cluster, "T": temperature}
        )
        out = _liger.fallback_function().apply(
            hidden, weight, target, temperature, ignore_index, return_entropy
        )
        if not return_entropy:
            return out
        nll, ent = out
        return nll, ent.bfloat16()


@pytest.fixture
def fake_native(monkeypatch: pytest.MonkeyPatch):
    FakeSM90.calls.clear()
    monkeypatch.setattr(availability, "native_reasons", lambda device, dtype: [])
    monkeypatch.setattr(_liger, "native_function", lambda: FakeSM90)
    return FakeSM90


def test_native_maps_nll_and_entropy_onto_the_contract(fake_native) -> None:
    hidden, weight, labels = small()
    labels = torch.tensor([1, 11, -100, -4])  # 11 and -4 are out of range for V=11
    lp, ent = forward(LigerBackend(), hidden, weight, labels)
    (call,) = fake_native.calls
    assert call["m_tiles"] == 1 and call["T"] == 1.0
    assert call["target"].tolist() == [1, -100, -100, -100]  # Liger never sees a bad label
    nll, ent_liger = FakeSM90.apply(hidden, weight, call["target"], 1.0, -100, 1, True)
    assert torch.equal(lp[0], -nll[0]) and lp[2] == 0
    assert ent.dtype == torch.float32 and torch.equal(ent[0], ent_liger[0].float())
    assert torch.isnan(lp[[1, 3]]).all() and torch.isnan(ent[[1, 3]]).all()


def test_native_without_entropy(fake_native) -> None:
    hidden, weight, labels = small()
    lp, ent = call_backend(LigerBackend(),
        hidden, weight, labels, temperature=0.5, ignore_index=-100, return_entropy=False,
        process_group=None, vocab_start=0, vocab_size=weight.shape[0], reduce_hidden_grad=True,
    )  # fmt: skip
    assert ent is None and lp.dtype == torch.float32 and torch.isfinite(lp).all()


def test_native_refuses_a_process_group(fake_native) -> None:
    with pytest.raises(BackendUnavailableError, match="liger-cute-kernels") as info:
        call_backend(LigerBackend(),
            *small(), temperature=1.0, ignore_index=-100, return_entropy=True,
            process_group=object(), vocab_start=0, vocab_size=11, reduce_hidden_grad=True,
        )  # fmt: skip
    assert '{"implementation": "fallback"}' in str(info.value)
