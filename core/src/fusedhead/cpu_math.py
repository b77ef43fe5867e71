"""A workaround for a silent CPU error in PyTorch's x86 wheels (pytorch/pytorch#188792).

ATen computes contiguous float ``exp``, ``log``, ``tanh``, ``sqrt``, ... with oneMKL's vector
math (VML), one call per intra-op thread on its chunk. oneMKL 2024.2 resolves each VML function's
kernel on its first call; when that first call runs on several threads at once, one thread can
run a low-accuracy kernel on its whole chunk. Measured here with torch 2.13 on 2 threads: the
first ``torch.exp`` of a fresh process was off by 1.5e-4 relative on half the rows in 8 of 140
processes, and the torch backend's first log-probs and entropy by 4e-5 in 2 of 72 (the
conformance kit's tightest bounds fail at that). After one call of each function on one thread
(ATen splits an op over threads from 32768 elements): 0 of 120 for each, the exp after 8
elements, the backend after 1024 (after 4 elements, the backend was still off in 1 of 120).
Remove once torch's wheels link oneMKL 2025.0 or later, or carry pytorch/pytorch#188791.
"""

from __future__ import annotations

#: The VML functions a head or the kit's float64 references run on the CPU.
FUNCTIONS = ("exp", "log", "log2", "tanh", "sqrt")

_resolved = False


def resolve_vml_dispatch() -> None:
    """Call each of ``FUNCTIONS`` once on 1024 fp32 and 1024 fp64 elements (one thread: ATen
    splits an op over threads from 32768 elements); once per process, before the first head
    call on the CPU."""
    global _resolved
    if _resolved:
        return
    import torch

    for dtype in (torch.float32, torch.float64):
        x = torch.ones(1024, dtype=dtype)
        for name in FUNCTIONS:
            getattr(torch, name)(x)
    _resolved = True
