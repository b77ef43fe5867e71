"""What ``torch.compile`` needs of the core: the tracing test, graph constants and slots.

A head (and its per-(device, dtype) readiness) is resolved eagerly while Dynamo traces, then read
by the graph as an attribute of a ``Slots`` object: the one mechanism that lets a compiled call
resolve its backend once and still see entries made later in the same trace.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

#: True while Dynamo traces (it folds the call), a plain ``return False`` eagerly: the one test
#: the eager hot path pays for the compiled one (30 ns, against 70 for ``is_compiling``, which
#: stands in on a torch without it).
tracing = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def as_graph_constant(fn: Any) -> Any:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does, without importing Dynamo
    (1.2 s) with this module: Dynamo then runs it while tracing and keeps its result as a
    constant of the graph, which is how a head is resolved inside a compiled function."""
    fn._dynamo_marked_constant = True
    return fn


class Slots:
    """What a compiled graph reads of a cache, one attribute per entry. Dynamo reads an
    attribute as it is at that moment, but a dict it has read once in a trace stays, for the
    rest of that trace, as it was then: entries made later in the trace would not be seen."""


#: Slot names are never reused: a stale graph never matches.
slot_numbers = itertools.count()
