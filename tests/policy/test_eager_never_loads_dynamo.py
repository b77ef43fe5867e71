"""A process that never compiles never imports Dynamo through fusedhead's calls on the torch
backend: ``torch.compiler.disable`` imports it (1.2 to 1.8 s of every such process's first call,
and of every CLI run and trainer script), so the calls Dynamo must not trace are disabled in
``fusedhead.untraced``, imported only where Dynamo is loaded."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import fusedhead

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, requires_grad=True)
    labels = torch.tensor([1, 2, -100, 4, 5, 6])
    out = fusedhead.fused_head(hidden, weight, labels, backend="torch")
    out.log_probs.sum().backward()
    fusedhead.fused_kl(hidden, weight, hidden.detach(), weight.detach() * 0.5, labels,
                       backend="torch").sum().backward()
    loss = fusedhead.fused_policy_loss(
        hidden, weight, labels, old_log_probs=torch.zeros(6), advantages=torch.ones(6),
        entropy_coef=0.01, backend="torch",
    )
    (loss.loss * 0.5).backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    print("dynamo loaded:", "torch._dynamo" in sys.modules)
    """
)


@pytest.mark.slow
def test_eager_calls_and_their_backward_never_import_dynamo() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "dynamo loaded: False"
