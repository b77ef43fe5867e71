"""liger-kernel itself: missing, of another version, failing to import, or returning something else.

Each is named as liger-kernel's problem, with the version found and the one needed, before
anything about devices; none runs Liger with arguments it reads differently, and none is blamed
on fusedhead-liger. Processes of their own where liger-kernel's import state matters.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from fusedhead.errors import (
    BackendContractError,
    BackendLoadError,
    BackendUnavailableError,
    MissingDependencyError,
)
from fusedhead.protocol import call_backend

pytest.importorskip(
    "fusedhead_liger",
    reason="the liger backend is not installed (pip install ./plugins/liger_backend)",
)
from fusedhead_liger import LigerBackend, LigerOptions, _liger, availability

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "liger_backend"


def fake_distribution(root: Path, version: str) -> Path:
    """A directory holding only liger-kernel's metadata at ``version``, to put first on sys.path."""
    info = root / f"liger_kernel-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: liger_kernel\nVersion: {version}\n"
    )
    return root


def small():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(6, 8, generator=gen), torch.randn(11, 8, generator=gen)


def forward(backend, hidden, weight, labels, return_entropy=True):
    return call_backend(backend,
        hidden, weight, labels, temperature=1.0, ignore_index=-100, return_entropy=return_entropy,
        process_group=None, vocab_start=0, vocab_size=weight.shape[0], reduce_hidden_grad=True,
    )  # fmt: skip


def run_python(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter (its last stdout line is JSON); that JSON."""
    import os

    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the version


@pytest.mark.parametrize("version", ["0.9.0", "0.6.0"])
@pytest.mark.parametrize("implementation", ["native", "fallback"])
def test_another_liger_version_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, implementation: str
) -> None:
    """A release with a positional ``chunk_size`` before ``return_entropy`` gave every row the
    same log-prob; 0.6.0 lacks the module (reported as 'needs liger-kernel' while installed)."""
    monkeypatch.syspath_prepend(str(fake_distribution(tmp_path, version)))
    backend = LigerBackend(LigerOptions(implementation=implementation))
    with pytest.raises(MissingDependencyError) as info:
        backend.check(CPU, torch.float32)
    exc = info.value
    assert isinstance(exc, BackendUnavailableError)  # what `fusedhead list --check` expects
    assert f"liger-kernel {version} is installed" in str(exc)
    assert "needs liger-kernel==0.8.5" in str(exc) and "pip install liger-kernel==0.8.5" in str(exc)
    assert "CUDA" not in str(exc)  # the dependency first, not the device
    assert backend.describe(CPU)["would_run"] == "no"


def test_the_runtime_pin_is_the_packaging_pin() -> None:
    pins = re.findall(r'^\s*"(liger-kernel[^";]*)"', (PLUGIN / "pyproject.toml").read_text(), re.M)
    assert pins == [f"liger-kernel{_liger.SUPPORTED_LIGER}"]
    assert _liger.require_liger() == _liger.TESTED_LIGER


def test_missing_liger_is_named_first_on_every_path() -> None:
    """Without liger-kernel, the default (native) check off SM90 said only 'not a CUDA GPU; CuTe
    DSL not installed' and offered the fallback, which then failed with another error."""
    result = run_python("""
        import importlib.abc, json, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "liger_kernel" or name.startswith("liger_kernel."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, Block())
        import torch
        from fusedhead import diagnostics, registry
        from fusedhead_liger import LigerBackend, LigerOptions
        out = {}
        for impl in ("native", "fallback"):
            try:
                LigerBackend(LigerOptions(implementation=impl)).check(torch.device("cpu"), torch.bfloat16)
            except Exception as exc:
                out[impl] = [[c.__name__ for c in type(exc).__mro__], str(exc)]
        status, reason = diagnostics.probe_backend(registry.find("liger"), "cpu")
        out["probe"] = [status.value, reason]
        print(json.dumps(out))
    """)
    for impl in ("native", "fallback"):
        mro, msg = result[impl]
        assert "MissingDependencyError" in mro and "BackendUnavailableError" in mro, impl
        assert msg.startswith("fusedhead-liger needs liger-kernel==0.8.5, which is not installed")
        assert "CUDA" not in msg and "CuTe DSL" not in msg
    status, reason = result["probe"]
    assert status == "unavailable" and "needs liger-kernel==0.8.5" in reason
    assert "report this to the backend's authors" not in reason


# ----------------------------------------------------------------------------- its import


def test_liger_import_failure_is_liger_kernels_and_names_the_variable() -> None:
    """LIGER_KERNEL_IMPL=cutedsl on a CPU makes liger-kernel's import raise RuntimeError; that
    was reported as fusedhead-liger's breach ('report this to the backend's authors')."""
    result = run_python(
        """
        import json, torch
        from fusedhead import fused_head
        try:
            fused_head(torch.randn(4, 8), torch.randn(16, 8), torch.tensor([1, 2, 3, 4]),
                       backend="liger", options={"implementation": "fallback"})
        except Exception as exc:
            print(json.dumps([[c.__name__ for c in type(exc).__mro__], str(exc)]))
        """,
        LIGER_KERNEL_IMPL="cutedsl",
    )
    mro, msg = result
    assert "BackendLoadError" in mro and "BackendContractError" not in mro
    assert "liger-kernel 0.8.5 fails to import" in msg and "RuntimeError" in msg
    assert "LIGER_KERNEL_IMPL='cutedsl'" in msg and "unset LIGER_KERNEL_IMPL" in msg
    assert "report this to the backend's authors" not in msg


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch):
    def set_gpu(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
        monkeypatch.setattr(torch.version, "hip", None)

    return set_gpu


def test_native_path_reports_ligers_own_import_failure(
    fake_gpu, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On an SM90 GPU a failing liger-kernel import was swallowed into 'Liger's CuTe DSL kernel
    does not import' with the fix 'install the CuTe DSL', also where the DSL was installed."""
    (tmp_path / "fake_liger_ops_boom.py").write_text(
        "raise RuntimeError(\"LIGER_KERNEL_IMPL='nope' is not an implementation\")\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_liger, "_FALLBACK_MODULE", "fake_liger_ops_boom")
    monkeypatch.setenv("LIGER_KERNEL_IMPL", "nope")
    fake_gpu((9, 0))
    monkeypatch.setattr(_liger, "cute_dsl_installed", lambda: True)
    _liger.native_import_error.cache_clear()
    try:
        with pytest.raises(BackendLoadError) as info:
            LigerBackend().check(CUDA, torch.bfloat16)
    finally:
        _liger.native_import_error.cache_clear()
    msg = str(info.value)
    assert "liger-kernel 0.8.5 fails to import fake_liger_ops_boom (RuntimeError:" in msg
    assert "LIGER_KERNEL_IMPL='nope'" in msg and "install the CuTe DSL" not in msg


def test_an_installed_dsl_that_fails_to_import_is_not_told_to_install_it(
    fake_gpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fix was picked by the substring 'CuTe DSL' of the reasons, which the import failure's
    reason contains too: 'install the CuTe DSL' where it was installed."""
    fake_gpu((9, 0))
    monkeypatch.setattr(_liger, "cute_dsl_installed", lambda: True)
    monkeypatch.setattr(
        _liger, "native_import_error", lambda: "RuntimeError: No CTK flavor installed"
    )
    with pytest.raises(BackendUnavailableError) as info:
        LigerBackend().check(CUDA, torch.bfloat16)
    msg = str(info.value)
    assert "No CTK flavor installed" in msg
    assert "install the CuTe DSL" not in msg
    assert "the CuTe DSL is installed" in msg and "fails to import" in msg
    assert [r.kind for r in availability.native_reasons(CUDA, torch.bfloat16)] == ["dsl_import"]


def test_missing_dsl_still_gets_the_install_command(
    fake_gpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpu((9, 0))
    monkeypatch.setattr(_liger, "cute_dsl_installed", lambda: False)
    with pytest.raises(BackendUnavailableError) as info:
        LigerBackend().check(CUDA, torch.bfloat16)
    assert f"install the CuTe DSL: {availability.INSTALL_HINT}" in str(info.value)
    assert "is installed" not in str(info.value)


# ----------------------------------------------------------------------------- what Liger returns


def new_signature() -> type:
    """A changed fallback function (the review's 0.9.0): a ``chunk_size`` before ``return_entropy``, so the
    adapter's ``return_entropy=True`` lands in ``chunk_size`` and Liger returns the NLL alone."""
    base = _liger.fallback_function()

    class Fallback090(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx, hidden, weight, ids, temperature, ignore_index, chunk_size, return_entropy=False):  # fmt: skip
            return base.forward(ctx, hidden, weight, ids, temperature, ignore_index, return_entropy)

    return Fallback090


def test_a_changed_liger_api_raises_instead_of_broadcasting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The NLL tensor alone, read as ``(out[0], out[1])``: two 0-d tensors broadcast over every
    row, every log-prob equal, no error."""
    fake = new_signature()
    monkeypatch.setattr(_liger, "fallback_function", lambda: fake)
    hidden, weight = small()
    with pytest.raises(BackendContractError) as info:
        forward(LigerBackend(LigerOptions(implementation="fallback")), hidden, weight,
                torch.tensor([1, 2, 3, 4, 5, -100]))  # fmt: skip
    msg = str(info.value)
    assert "liger-kernel 0.8.5's" in msg and "_FusedLinearPPOFallbackFunction" in msg
    assert "a tensor of shape [6] (float32)" in msg and "expected (nll, entropy)" in msg


class FakeSM90:
    """The SM90 function's stand-in, returning what a changed kernel might: 0-d tensors."""

    outputs: ClassVar[tuple] = ()

    @classmethod
    def apply(cls, *args):
        return cls.outputs


@pytest.mark.parametrize(
    "outputs",
    [
        (torch.zeros(()), torch.zeros(())),  # scalars: would broadcast
        (torch.zeros(6), torch.zeros(6), torch.zeros(6)),  # another arity
        (torch.zeros(6, dtype=torch.float64), torch.zeros(6)),  # nll not fp32
        (torch.zeros(5), torch.zeros(5)),  # another row count
    ],
)
def test_native_outputs_are_checked(monkeypatch: pytest.MonkeyPatch, outputs) -> None:
    monkeypatch.setattr(availability, "native_reasons", lambda device, dtype: [])
    monkeypatch.setattr(FakeSM90, "outputs", outputs)
    monkeypatch.setattr(_liger, "native_function", lambda: FakeSM90)
    hidden, weight = small()
    with pytest.raises(BackendContractError, match="expected \\(nll, entropy\\), each a tensor"):
        forward(LigerBackend(), hidden, weight, torch.tensor([1, 2, 3, 4, 5, -100]))
