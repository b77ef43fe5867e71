"""The autograd boundary (``ops``): custom ops that ``torch.compile(fullgraph=True)`` traces,
valid fake-tensor implementations, a refused double backward; and softcap's tanh at any |x|."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from triton_backend_helpers import (
    SMALL_TILES,
    TOLERANCE,
    assert_close,
    make_case,
    rel_err,
    run_reference,
    run_triton,
)

from fusedhead.protocol import call_backend
from fusedhead_triton import TritonBackend, TritonOptions
from fusedhead_triton.custom_ops import DOUBLE_BACKWARD

MANY_BLOCKS: dict[str, Any] = {**SMALL_TILES, "backward_block_mib": 1e-4}


def _head_fn(be: TritonBackend) -> Any:
    def head(h: torch.Tensor, w: torch.Tensor, lab: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lp, ent = call_backend(be, h, w, lab, temperature=0.7)
        assert ent is not None
        return lp, ent

    return head


def _grads(fn: Any, h0: torch.Tensor, w0: torch.Tensor, lab: torch.Tensor) -> list[torch.Tensor]:
    """Outputs and both gradients, the outputs' gradients given (no reduction outside the op
    that a compiler could reorder)."""
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    lp, ent = fn(h, w, lab)
    g = torch.Generator().manual_seed(4)
    g_lp = torch.randn(lp.shape, generator=g).to(lp.device)
    g_ent = torch.randn(ent.shape, generator=g).to(ent.device)
    torch.autograd.backward([lp, ent], [g_lp, g_ent])
    return [lp.detach(), ent.detach(), h.grad, w.grad]


def _inputs(device: str, dtype: torch.dtype, n: int = 40, h: int = 64, v: int = 333) -> tuple:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(device=device, dtype=dtype)
    return hidden, weight, torch.randint(0, v, (n,), generator=g).to(device)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_matches_eager_on_the_interpreter(backend: str) -> None:
    """Dynamo traces the call whole (no graph break: fullgraph raises on one); the two custom
    ops run the same kernels, so forward and both gradients keep their bits."""
    torch._dynamo.reset()
    be = TritonBackend(TritonOptions(**MANY_BLOCKS, tma=True))
    hidden, weight, lab = _inputs("cpu", torch.float16)
    eager = _grads(_head_fn(be), hidden, weight, lab)
    compiled = _grads(
        torch.compile(_head_fn(be), fullgraph=True, backend=backend), hidden, weight, lab
    )
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


def test_a_heads_first_call_may_be_compiled() -> None:
    """A head whose first call on a dtype runs under torch.compile(fullgraph=True): its kernel
    settings are made in the backend's check, which the core runs eagerly while Dynamo traces.
    They were made in forward, where their json key broke the trace (Dynamo's Unsupported
    "__new__ of class type") unless an eager call on that dtype came first."""
    from fusedhead import FusedHead

    torch._dynamo.reset()
    head = FusedHead({"backend": "triton", "options": {**SMALL_TILES, "memory": "fast"}})
    hidden, weight, lab = _inputs("cpu", torch.float32, 16, 32, 70)

    def step(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return head(h, w, y, temperature=0.7).log_probs

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(hidden, weight, lab)
    assert torch.equal(compiled, step(hidden, weight, lab))


def test_custom_ops_pass_opcheck() -> None:
    """Schema, fake-tensor shapes, autograd registration: what torch.compile relies on."""
    hidden, weight, lab = _inputs("cpu", torch.float32, 8, 32, 50)
    key = TritonBackend(TritonOptions(**SMALL_TILES))._settings(torch.float32)[1]
    fwd_args = (
        hidden.requires_grad_(),
        weight.requires_grad_(),
        lab,
        None,
        0,
        -100,
        1.0,
        None,
        True,
        key,
    )
    torch.library.opcheck(torch.ops.fusedhead_triton.head_forward, fwd_args, test_utils=(
        "test_schema", "test_faketensor", "test_aot_dispatch_static",
    ))  # fmt: skip
    logp, norm, ent = torch.ops.fusedhead_triton.head_forward(*fwd_args)
    assert norm.shape == (2, logp.shape[0])  # each row's max and log s, for the backward
    g = torch.ones_like(logp)
    bwd_args = (hidden.detach(), weight.detach(), lab, None, norm.detach(), logp.detach(),
                ent.detach(), g, None, 0, -100, 1.0, None, key, True, False)  # fmt: skip
    torch.library.opcheck(torch.ops.fusedhead_triton.head_backward, bwd_args,
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip
    dh, dw = torch.ops.fusedhead_triton.head_backward(*bwd_args)
    assert dh.shape == hidden.shape and dw.numel() == 0


def test_double_backward_is_refused_not_silently_first_order() -> None:
    """A gradient penalty: the first-order gradient comes back, attached to the graph; asking
    for its own gradient raises a clear error (it used to come back detached, so the penalty
    vanished from the loss without a word)."""
    be = TritonBackend(TritonOptions(**SMALL_TILES))
    hidden, weight, lab = _inputs("cpu", torch.float32, 8, 32, 50)
    h = hidden.requires_grad_()
    w = weight.requires_grad_()
    lp, _ = call_backend(be, h, w, lab)
    (g,) = torch.autograd.grad(lp.sum(), h, create_graph=True)
    want = run_reference(make_case(8, 32, 50, seed=0), torch.float32)  # shapes only
    assert g.shape == want.d_hidden.shape
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="double backward"):
        (g.pow(2).sum() + lp.sum()).backward()
    assert "create_graph=True" in DOUBLE_BACKWARD and "full logits" in DOUBLE_BACKWARD
    # The torch backend refuses a double backward too (tests/outputs/test_double_backward.py):
    # the message once sent users there for second-order gradients.
    assert "backend='torch'" not in DOUBLE_BACKWARD


# --- softcap's tanh --------------------------------------------------------------------------

_common: Any = None


def _tanh(x: torch.Tensor) -> torch.Tensor:
    """``kernels.common.tanh_f32`` of fp32 ``x``, under this test's interpreter."""
    global _common
    from fusedhead_triton.kernels import common

    _common = common

    @triton.jit
    def kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, _common.tanh_f32(tl.load(x_ptr + offs, mask=mask)), mask=mask)

    y = torch.empty_like(x)
    kernel[(math.ceil(x.numel() / 1024),)](x, y, x.numel(), BLOCK=1024)
    return y


def test_tanh_is_fp32_accurate_at_every_magnitude() -> None:
    """Relative error within a few fp32 ulps from 1e-38 to saturation, both signs (the old
    ``1 - 2 / (exp(2x) + 1)`` was 1e-3 off at |x| = 1e-4 and returned 0 below 3e-8)."""
    mags = torch.cat([torch.logspace(-38, 1.5, 40001), torch.linspace(0.55, 0.7, 2001)])
    x = torch.cat([mags, -mags]).float()
    y = _tanh(x)
    want = torch.tanh(x.double())
    rel = (y.double() - want).abs() / want.abs()
    assert float(rel.max()) <= 4 * 2.0**-24, float(rel.max())
    big = torch.tensor([20.0, -20.0, 1e30, -1e30, math.inf, -math.inf])
    with warnings.catch_warnings():
        # past |x| = 44 exp2 overflowed (and x * x past 1.8e19): the interpreter's NumPy printed
        # "overflow encountered" hundreds of times a softcapped call, for the right values
        warnings.simplefilter("error")
        assert _tanh(big).tolist() == [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
        assert bool(torch.isnan(_tanh(torch.tensor([math.nan]))).all())


@pytest.mark.parametrize("softcap", [1e3, 30.0])
def test_a_large_softcap_over_tiny_logits(softcap: float) -> None:
    """fp16, H = 1, V = 15 (the fuzzed case): z / softcap tiny, where the cancellation was."""
    case = make_case(16, 1, 15, seed=50)
    got = run_triton(case, torch.float16, softcap=softcap, options=SMALL_TILES)
    want = run_reference(case, torch.float16, softcap=softcap)
    assert_close(got, want, torch.float16)
    assert rel_err(got.log_probs, want.log_probs) <= TOLERANCE[torch.float16][0] / 4
