"""The CPU's vector-math dispatch is resolved on one thread before a head's first CPU call.

PyTorch's x86 wheels link oneMKL 2024.2, whose vector math (``exp``, ``log``, ``tanh`` ...)
picks each function's kernel on its first call; a first call on several threads at once can run
a low-accuracy kernel on one thread's chunk (pytorch/pytorch#188792). Measured with torch 2.13
on 2 threads (``fusedhead.cpu_math``): the torch backend's first log-probs of a fresh process
were off by 4e-5 in 2 of 72 processes, and in 0 of 120 after the resolution. The race cannot be
forced, so this test checks the order: the resolution runs before the backend's check and its
first forward.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import torch
    import fusedhead
    from fusedhead import cpu_math, registry

    seen = []
    backend = registry.load_class("torch")
    check, forward = backend.check, backend.forward

    def traced_check(self, device, dtype):
        seen.append(("check", cpu_math._resolved))
        return check(self, device, dtype)

    def traced_forward(self, call):
        seen.append(("forward", cpu_math._resolved))
        return forward(self, call)

    backend.check, backend.forward = traced_check, traced_forward
    assert not cpu_math._resolved
    hidden, weight = torch.randn(6, 8), torch.randn(11, 8)
    fusedhead.fused_head(hidden, weight, torch.tensor([1, 2, -100, 4, 5, 6]), backend="torch")
    print(seen)
    """
)


def test_vml_dispatch_is_resolved_before_the_first_cpu_call_of_a_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[('check', True), ('forward', True)]"
