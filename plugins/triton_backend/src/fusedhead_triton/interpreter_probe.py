"""Whether Triton's CPU interpreter runs this backend's kernels in this environment.

Triton 3.6's interpreter turns a kernel's scalar into a Python index with ``int`` of a
one-element array, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
scalars"; triton-lang/triton#9171, fixed by #9172): every persistent-loop kernel here
(``range(tl.program_id(0), ...)``) then fails inside the interpreter. A one-program probe of that
loop says so before a call does, as a reason the backend is unavailable.
"""

from __future__ import annotations

import functools

import torch


def _run_probe() -> None:
    """One program of a ``range(tl.program_id(0), n)`` loop, made now (under the interpreter)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe_kernel(out_ptr, n):  # type: ignore[no-untyped-def]  # typed by Triton
        for i in range(tl.program_id(0), n, 1):
            tl.store(out_ptr + i, i)

    out = torch.full((2,), -1, dtype=torch.int32)
    probe_kernel[(1,)](out, 2)
    if out.tolist() != [0, 1]:
        raise RuntimeError(f"the probe wrote {out.tolist()}, expected [0, 1]")


@functools.cache
def interpreter_problem() -> str | None:
    """None where the interpreter runs the probe; else why not and the fix (asked once)."""
    try:
        _run_probe()
    except Exception as err:  # the interpreter's own failure, whatever its type
        import numpy
        import triton

        return (
            f"Triton {triton.__version__}'s CPU interpreter fails under NumPy "
            f"{numpy.__version__} ({type(err).__name__}: {err}); a Triton with "
            "triton-lang/triton#9172 (3.9 has it) or NumPy older than 2.4 runs it, "
            "or use backend='torch'"
        )
    return None
