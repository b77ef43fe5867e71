"""The suite's sessions (tests/conftest.py): on a CUDA machine any session but a GPU session is the
CPU suite, the GPU hidden and the ``gpu`` tests skipped with that reason; ``-m`` decides, as
pytest evaluates it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from suite_sessions import GPU_SESSION_ONLY, HID_CUDA, is_gpu_session

ROOT = Path(__file__).parents[1]


class _Options:
    def __init__(self, markexpr: str) -> None:
        self.markexpr = markexpr

    def getoption(self, name: str, default: object = None) -> object:
        return self.markexpr if name == "markexpr" else default


@pytest.mark.parametrize(
    ("markexpr", "gpu_session"),
    [
        ("gpu", True),
        ("gpu and slow", True),
        ("gpu and not slow", True),
        ("(gpu)", True),
        ("not (not gpu)", True),
        ("", False),
        ("not gpu", False),
        ("slow", False),
        ("gpu or slow", False),  # selects CPU tests too
        ("gpu or packaging", False),
    ],
)
def test_a_gpu_session_selects_gpu_tests_and_only_those(markexpr: str, gpu_session: bool) -> None:
    assert is_gpu_session(_Options(markexpr)) is gpu_session  # type: ignore[arg-type]


def test_a_cuda_machines_cpu_suite_hides_the_gpu_and_says_why_gpu_tests_skip() -> None:
    """As the controller found a GPU: the session hides it and gives its own reason first, before a
    test's ``skipif(not torch.cuda.is_available())``."""
    probes = [  # the GPU marks on a module, and on a function beside its own skipif
        "tests/torch_backend/test_torch_recompute_cuda.py",
        "tests/torch_backend/test_torch_backend_math.py::test_cuda_matches_float64_reference",
    ]
    env = {**os.environ, HID_CUDA: "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *probes],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:]
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all(GPU_SESSION_ONLY[:40] in line for line in skipped), skipped
