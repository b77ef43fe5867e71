"""Whether Triton's CPU interpreter runs this backend's kernels in this environment.

Triton 3.6's interpreter turns a kernel's scalar into a Python index with ``int`` of a
one-element array, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
scalars"; triton-lang/triton#9171, fixed by #9172): every persistent-loop kernel here
(``range(tl.program_id(0), ...)``) then fails inside the interpreter. A one-program probe of that
loop says so before a call does, as a reason the backend is unavailable.
"""

from __future__ import annotations

import threading

import torch

#: The interpreter patches ``triton.language`` for the whole process while a kernel runs: one
#: probe at a time, and its verdict kept once it is known.
_LOCK = threading.Lock()
_VERDICT: list[str | None] = []


def _run_probe() -> None:
    """One program of a ``range(tl.program_id(0), n)`` loop, made now (under the interpreter)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe_kernel(out_ptr, n):  # type: ignore[no-untyped-def]  # typed by Triton
        for i in range(tl.program_id(0), n, 1):
            tl.store(out_ptr + i, i)

    out = torch.full((2,), -1, dtype=torch.int32, device="cpu")
    probe_kernel[(1,)](out, 2)
    if out.tolist() != [0, 1]:
        raise RuntimeError(f"the probe wrote {out.tolist()}, expected [0, 1]")


def _reason(err: Exception) -> str:
    """Why the interpreter cannot run the kernels: the NumPy 2.4 defect by name, else the error."""
    import numpy
    import triton

    if "0-dimensional arrays" in str(err):
        return (
            f"Triton {triton.__version__}'s CPU interpreter fails under NumPy {numpy.__version__} "
            f"({type(err).__name__}: {err}; triton-lang/triton#9171): a Triton with #9172 "
            "(3.9 has it) or NumPy older than 2.4 runs it, or use backend='torch'"
        )
    return (
        f"Triton {triton.__version__}'s CPU interpreter failed a one-program probe of this "
        f"backend's loops ({type(err).__name__}: {err}); use backend='torch'"
    )


def interpreter_problem() -> str | None:
    """None where the interpreter runs the probe; else why not and the fix (probed once)."""
    with _LOCK:
        if not _VERDICT:
            try:
                _run_probe()
                _VERDICT.append(None)
            except Exception as err:  # the interpreter's own failure, whatever its type
                _VERDICT.append(_reason(err))
        return _VERDICT[0]


def forget() -> None:
    """Probe again on the next ask (tests)."""
    with _LOCK:
        _VERDICT.clear()
