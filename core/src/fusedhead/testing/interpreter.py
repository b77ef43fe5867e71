"""Whether bitwise batch invariance can be checked on the CPU under the Triton interpreter.

Under ``TRITON_INTERPRET=1`` a Triton kernel's ``tl.dot`` is NumPy's float32 matmul. Some of
OpenBLAS's sgemm kernels (NumPy's BLAS: the Haswell and Zen ones, picked by the CPU or by
``OPENBLAS_CORETYPE``) give a row other last bits at another place in the matrix, so a kernel that
is batch invariant (as it is on a GPU) reads as not invariant there. The kit then reports its
bitwise batch-invariance properties as not run, with this reason, rather than failed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from fusedhead.testing.outcome import NotRun, PropertyFailure
from fusedhead.testing.target import Target

#: How to load row-invariant OpenBLAS kernels on x86-64 (read when OpenBLAS loads).
FIX = "set OPENBLAS_CORETYPE=Sandybridge (x86-64) before Python starts, then run the check again"


@functools.lru_cache(maxsize=1)
def numpy_matmul_row_invariant() -> bool:
    """True when NumPy's float32 matmul gives each row the same bits wherever it sits."""
    import numpy as np

    rng = np.random.default_rng(0)
    for m, k, n in ((16, 16, 16), (32, 32, 64), (64, 64, 64)):
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        perm = rng.permutation(m)
        if not np.array_equal(a[perm] @ b, (a @ b)[perm]):
            return False
    return True


def interpreted_on_cpu(target: Target) -> bool:
    """A CPU target with the Triton interpreter switched on (its kernels, if any, interpreted)."""
    flag = os.environ.get("TRITON_INTERPRET", "0").strip().lower()
    return target.device.type == "cpu" and flag in ("1", "true", "on", "yes")


def unless_interpreter_dot_varies(
    prop: Callable[[Target], None],
) -> Callable[[Target], None]:
    """``prop`` (a bitwise batch-invariance property), whose failure under the interpreter on a
    BLAS that is not row-invariant is reported as not run, naming the cause, the failure and the fix."""

    @functools.wraps(prop)
    def checked(target: Target) -> None:
        try:
            prop(target)
        except PropertyFailure as exc:
            if interpreted_on_cpu(target) and not numpy_matmul_row_invariant():
                raise NotRun(
                    "cannot be checked bitwise here: under TRITON_INTERPRET=1, tl.dot is NumPy's "
                    "matmul, and this machine's OpenBLAS kernels give a row other bits at another "
                    f"place in the matrix ({exc}); {FIX}"
                ) from None
            raise

    return checked
