"""A compiled policy-loss call that is the process's first on its (device, dtype) runs the
backend's check eagerly, as a compiled ``fused_head`` does.

It ran the check under Dynamo: the torch backend's trial of ``mm`` into an fp32 output on 16-bit
CPU inputs was compiled into the graph, raised at run time past the check's own ``except``, and
every compiled call failed ("report this to the backend's authors") until one eager call had
run. A fresh process is the only cold one: the check's result is cached for the process.
"""

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

    dtype = getattr(torch, sys.argv[1])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 16, generator=g).to(dtype)
    weight = (torch.randn(40, 16, generator=g) / 3).to(dtype)
    labels = torch.randint(0, 40, (2, 5), generator=g)
    labels[1, 3] = -100
    advantages = torch.randn(2, 5, generator=g)

    def step(h, w):
        return fusedhead.fused_policy_loss(
            h, w, labels, old_log_probs=None, advantages=advantages, entropy_coef=0.01,
            backend="torch",
        ).loss

    results = []
    for fn in (torch.compile(step, backend="eager"), step):  # compiled first: the cold call
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    for name, got, want in zip(("loss", "grad hidden", "grad weight"), *results):
        assert torch.equal(got, want), name
    print("compiled first call: eager bits")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_cold_compiled_call_on_16_bit_inputs_is_the_eager_call(dtype: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, dtype], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "compiled first call: eager bits"
