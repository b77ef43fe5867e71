"""The Liger call as ``torch.compile`` runs it: eagerly, behind a graph break.

Liger's functions check the labels on the host (``bool(tensor.any())``, a data-dependent branch)
and its SM90 kernel is a CuTe DSL launch; neither goes into a graph. Marking the whole call
``torch.compiler.disable`` makes that one clean graph break (the rest of a compiled step still
compiles) instead of Dynamo tracing into Liger and breaking where it may, and gives
``fullgraph=True`` an error that says why. Imported only while Dynamo traces: ``disable`` imports
Dynamo, which a process that never compiles should not pay for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fusedhead.protocol import HeadCall, HeadOutput

#: Why the call is not traced, as Dynamo shows it under ``fullgraph=True``.
REASON = (
    "backend 'liger' does not trace under torch.compile(fullgraph=True): liger-kernel's functions "
    "read the labels on the host (a data-dependent check) and its SM90 kernel is a CuTe DSL "
    "launch, so the liger call runs eagerly behind a graph break. Compile with fullgraph=False, "
    "or use backend='torch' or 'triton' for a single graph"
)


def liger_call_runs_eagerly(
    liger_call: Callable[[HeadCall], HeadOutput], call: HeadCall
) -> HeadOutput:
    """``liger_call(call)`` (the backend's Liger call); under torch.compile, run as in eager mode."""
    return liger_call(call)


run: Callable[[Callable[[HeadCall], HeadOutput], HeadCall], HeadOutput]
run = torch.compiler.disable(liger_call_runs_eagerly, reason=REASON)  # type: ignore[no-untyped-call]
