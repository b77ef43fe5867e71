"""Which session the suite runs (tests/conftest.py acts on it): the CPU suite, as CI runs it, or a
GPU session (``-m gpu``). Triton fixes compiled or interpreted kernels for a whole process, so on
a CUDA machine the CPU suite hides the GPU."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys

import pytest
import torch

#: Why a test marked ``gpu`` is skipped on a CUDA machine in a session that is not a GPU session.
GPU_SESSION_ONLY = (
    "the GPU tests run in a session of their own: `python -m pytest -m gpu` (this session is the "
    "CPU suite, the GPU hidden: Triton fixes compiled or interpreted kernels for a whole process)"
)
#: Set when this session hid a CUDA device (``pytest_configure``).
HID_CUDA = "FUSEDHEAD_TESTS_HID_CUDA"


def has_cuda_device() -> bool:
    """Whether CUDA has a device, asked in a child process: asking here would fix this process's
    view of the devices before ``CUDA_VISIBLE_DEVICES`` can hide them."""
    if torch.version.cuda is None and torch.version.hip is None:
        return False  # a CPU build of torch: nothing to ask
    code = "import torch; print(torch.cuda.device_count())"
    try:
        child = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return True  # a driver that hangs: hidden all the same, the gpu tests say why
    return child.stdout.strip() not in ("", "0")


def is_gpu_session(config: pytest.Config) -> bool:
    """Whether ``-m`` selects only tests marked ``gpu``, and some (``-m gpu``, ``-m "gpu and
    slow"``; not ``-m "gpu or slow"``): then no test runs Triton's kernels on the CPU. Decided over
    every set of the marks the expression names, as pytest's own ``-m`` evaluates it."""
    from _pytest.mark.expression import Expression  # pytest's own -m parser

    text = str(config.getoption("markexpr", "") or "")
    if not text:
        return False
    expression = Expression.compile(text)
    names = sorted(set(re.findall(r"[A-Za-z_][\w.-]*", text)) - {"and", "or", "not", "gpu"})
    selects = {False: False, True: False}  # by whether the test is marked gpu
    for marks in itertools.product((False, True), repeat=len(names)):
        for gpu in (False, True):
            chosen = {name for name, on in zip(names, marks) if on} | ({"gpu"} if gpu else set())
            matched = expression.evaluate(lambda name, chosen=chosen, **_: name in chosen)
            selects[gpu] = selects[gpu] or bool(matched)
    return selects[True] and not selects[False]
