"""The triton backend's KL of two heads under the interpreter (fp32, fp16): values and the
student's gradients against float64 full logits and against the torch backend, both directions,
different hidden sizes and temperatures per head, ignored rows, odd shapes; batch invariance,
determinism, the teacher never differentiated, the custom ops under torch.compile."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from triton_backend_helpers import IGNORE, SMALL_TILES, TOLERANCE, make_case, rel_err

from fusedhead import fused_kl
from fusedhead.protocol import KLCall
from fusedhead.testing import Outcome, check_property
from fusedhead_triton import TritonBackend, TritonOptions
from fusedhead_triton.configs import kl_tile
from fusedhead_triton.custom_ops import DOUBLE_BACKWARD
from fusedhead_triton.kl import CHUNK, KLScalars
from fusedhead_triton.launch import tma_usable

DTYPES = [torch.float32, torch.float16]
DIRECTIONS = ["forward", "reverse"]
#: Tiles small enough that tiny shapes span many row tiles, vocabulary tiles and chunks.
TINY: dict[str, Any] = {"block_m": 16, "block_n": 16, "block_k": 16}


class Heads:
    """A student head and a teacher head (float64 values; the teacher's H differs)."""

    def __init__(self, n: int, h: int, h_t: int, v: int, seed: int = 0) -> None:
        student = make_case(n, h, v, seed=seed, peak=2.0)
        teacher = make_case(n, h_t, v, seed=seed + 100, peak=3.0, ignore_every=0)
        self.hidden, self.weight, self.labels = student.hidden, student.weight, student.labels
        self.t_hidden, self.t_weight = teacher.hidden, teacher.weight
        self.g = torch.randn(
            n, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64
        )


def _kl(
    heads: Heads, dtype: torch.dtype, direction: str, *, options: dict[str, Any] | None = None,
    backend: str = "triton", temperature: Any = 0.7, teacher_temperature: Any = 1.3,
    rows: slice | torch.Tensor | None = None, **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(kl, d hidden, d weight) of one call through ``fused_kl``, the case's upstream gradient."""
    pick = slice(None) if rows is None else rows
    hs = heads.hidden[pick].to(dtype).requires_grad_()
    ws = heads.weight.to(dtype).requires_grad_()
    ht, wt = heads.t_hidden[pick].to(dtype), heads.t_weight.to(dtype)
    out = fused_kl(
        hs, ws, ht, wt, heads.labels[pick], direction=direction, backend=backend,
        temperature=temperature, teacher_temperature=teacher_temperature,
        options=options if options is not None else SMALL_TILES, **kw,
    )  # fmt: skip
    (out.double() * heads.g[pick]).sum().backward()
    assert hs.grad is not None and ws.grad is not None
    return out.detach(), hs.grad, ws.grad


def _logits(h: torch.Tensor, w: torch.Tensor, t: Any, cap: float | None) -> torch.Tensor:
    z = h @ w.T
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return z / (t.double().unsqueeze(1) if isinstance(t, torch.Tensor) else t)


def _reference(
    heads: Heads, dtype: torch.dtype, direction: str, temperature: Any = 0.7,
    teacher_temperature: Any = 1.3, softcap: float | None = None,
    teacher_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """float64 full-logits KL on the values the backend saw, and the student's gradients."""
    hs = heads.hidden.to(dtype).double().requires_grad_()
    ws = heads.weight.to(dtype).double().requires_grad_()
    ht, wt = heads.t_hidden.to(dtype).double(), heads.t_weight.to(dtype).double()
    ls = torch.log_softmax(_logits(hs, ws, temperature, softcap), -1)
    lt = torch.log_softmax(_logits(ht, wt, teacher_temperature, teacher_softcap), -1)
    a, b = (lt, ls) if direction == "forward" else (ls, lt)
    kl = torch.where(heads.labels != IGNORE, (a.exp() * (a - b)).sum(-1), 0.0)
    (kl * heads.g).sum().backward()
    assert hs.grad is not None and ws.grad is not None
    return kl.detach(), hs.grad, ws.grad


def _assert_close(
    got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], dtype: torch.dtype
) -> None:
    out_tol, grad_tol = TOLERANCE[dtype]
    kl, dh, dw = got
    assert kl.dtype == torch.float32 and dh.dtype == dtype and dw.dtype == dtype
    assert rel_err(kl, want[0]) <= out_tol
    assert rel_err(dh, want[1]) <= grad_tol and rel_err(dw, want[2]) <= grad_tol


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(
    ("n", "h", "h_t", "v"),
    [(37, 48, 33, 301), (64, 64, 64, 256), (1, 40, 17, 77), (20, 24, 56, 1000)],
    ids=["odd", "even", "one-row", "teacher-wider"],
)
def test_matches_float64_full_logits(
    n: int, h: int, h_t: int, v: int, dtype: torch.dtype, direction: str
) -> None:
    heads = Heads(n, h, h_t, v, seed=n + v)
    got = _kl(heads, dtype, direction)
    want = _reference(heads, dtype, direction)
    _assert_close(got, want, dtype)
    assert torch.all(got[0][heads.labels == IGNORE] == 0)
    assert torch.all(got[1][heads.labels == IGNORE] == 0)  # ignored rows: exactly no gradient


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_both_loaders_many_chunks_and_backward_blocks(
    dtype: torch.dtype, tma: bool, direction: str
) -> None:
    """More than 64 chunks (the combine's several steps), a last chunk of fewer tiles than CHUNK,
    a ragged last tile, and many backward blocks (the dense fp32 hidden-gradient sum in fp16)."""
    v = 64 * CHUNK * 16 + 3 * 16 + 5
    heads = Heads(9, 24, 40, v, seed=5)  # rows of 16-byte multiples: TMA applies where asked
    st = TritonBackend(TritonOptions(**TINY, tma=tma))._settings(dtype)[0]
    assert all(
        tma_usable(kl_tile(st.forward), dtype, h, torch.device("cpu")) == tma for h in (24, 40)
    )
    options = {**TINY, "tma": tma, "backward_block_mib": 1e-3}
    got = _kl(heads, dtype, direction, options=options)
    _assert_close(got, _reference(heads, dtype, direction), dtype)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_per_token_temperatures_of_either_head(direction: str) -> None:
    heads = Heads(30, 32, 24, 200, seed=8)
    g = torch.Generator().manual_seed(9)
    t_s = torch.rand(30, generator=g) * 1.5 + 0.4
    t_t = torch.rand(30, generator=g) * 1.5 + 0.4
    for ts, tt in ((t_s, t_t), (t_s, 1.1), (0.8, t_t)):
        got = _kl(heads, torch.float32, direction, temperature=ts, teacher_temperature=tt)
        _assert_close(got, _reference(heads, torch.float32, direction, ts, tt), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_agrees_with_the_torch_backend(dtype: torch.dtype, direction: str) -> None:
    heads = Heads(33, 40, 28, 250, seed=11)
    got = _kl(heads, dtype, direction)
    ref = _kl(heads, dtype, direction, backend="torch", options={})
    _assert_close(got, ref, dtype)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_identical_heads_give_exactly_zero(direction: str) -> None:
    """Same tiles bitwise: the cross term is 0 and both sums equal, so KL and dz are exactly 0."""
    heads = Heads(21, 32, 32, 150, seed=12)
    heads.t_hidden, heads.t_weight = heads.hidden, heads.weight
    kl, dh, dw = _kl(heads, torch.float32, direction, temperature=0.9, teacher_temperature=0.9)
    assert torch.all(kl == 0) and torch.all(dh == 0) and torch.all(dw == 0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_rows_kl_does_not_depend_on_the_batch_and_runs_repeat_bitwise(
    dtype: torch.dtype, direction: str
) -> None:
    n = 50
    heads = Heads(n, 24, 40, 300, seed=13)
    temp = torch.rand(n, generator=torch.Generator().manual_seed(1)) + 0.5

    be = TritonBackend(TritonOptions(**TINY))

    def run(rows: slice | torch.Tensor) -> torch.Tensor:
        hs, ht = heads.hidden[rows].to(dtype), heads.t_hidden[rows].to(dtype)
        ws, wt = heads.weight.to(dtype), heads.t_weight.to(dtype)
        valid = heads.labels[rows] != IGNORE
        with torch.no_grad():
            return be.kl(KLCall(hs, ws, ht, wt, valid, temp[rows], 1.3, direction)).kl

    full = run(slice(None))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(2))
    assert torch.equal(run(perm), full[perm])
    assert torch.equal(run(slice(5, 38)), full[5:38])  # starts inside a row tile
    for i in (0, 17, n - 1):
        assert torch.equal(run(slice(i, i + 1)), full[i : i + 1])
    once = _kl(heads, dtype, direction, options=TINY, temperature=temp)
    again = _kl(heads, dtype, direction, options=TINY, temperature=temp)
    assert all(torch.equal(a, b) for a, b in zip(once, again))


def test_the_teacher_is_read_never_differentiated() -> None:
    heads = Heads(12, 16, 20, 90, seed=14)
    hs, ws = heads.hidden.float().requires_grad_(), heads.weight.float().requires_grad_()
    ht, wt = heads.t_hidden.float().requires_grad_(), heads.t_weight.float().requires_grad_()
    out = fused_kl(hs, ws, ht, wt, heads.labels, backend="triton", options=SMALL_TILES)
    out.sum().backward()
    assert ht.grad is None and wt.grad is None
    assert hs.grad is not None and ws.grad is not None
    # one student leaf at a time: the other gradient is never formed
    want = _reference(heads, torch.float32, "forward", 1.0, 1.0)
    for leaf in ("hidden", "weight"):
        h = heads.hidden.float().requires_grad_(leaf == "hidden")
        w = heads.weight.float().requires_grad_(leaf == "weight")
        out = fused_kl(h, w, ht, wt, heads.labels, backend="triton", options=SMALL_TILES)
        (out.double() * heads.g).sum().backward()
        got, ref = (h.grad, want[1]) if leaf == "hidden" else (w.grad, want[2])
        assert got is not None and rel_err(got, ref) <= 1e-5
        assert (w.grad if leaf == "hidden" else h.grad) is None


def test_settings_and_capabilities() -> None:
    be = TritonBackend(TritonOptions())
    assert be.capabilities(torch.device("cpu")).kl_directions == ("forward", "reverse")
    st = be._settings(torch.float16)[0]
    # both heads' tiles at once: the log-prob kernels' 256-wide TMA tile narrowed to 128
    assert st.forward.block_n == 256 and kl_tile(st.forward).block_n == 128
    assert kl_tile(st.dz).block_m == st.dz.block_m
    assert kl_tile(be._settings(torch.float32)[0].forward).block_n <= 128  # pointer loads
    assert KLScalars(0.5, 2.0, 30.0, None, True).args() == (0.5, 2.0, 30.0, 1 / 30.0, 0.0, 0.0)


def test_a_temperature_that_requires_grad_is_refused_by_name() -> None:
    heads = Heads(4, 8, 8, 20, seed=15)
    call = KLCall(
        hidden=heads.hidden.float(), weight=heads.weight.float(),
        teacher_hidden=heads.t_hidden.float(), teacher_weight=heads.t_weight.float(),
        valid=torch.ones(4, dtype=torch.bool), temperature=torch.ones(4, requires_grad=True),
        teacher_temperature=1.0, direction="forward",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"^temperature: .*temperature\.detach\(\)"):
        TritonBackend(TritonOptions(**SMALL_TILES)).kl(call)


def test_double_backward_is_refused() -> None:
    heads = Heads(6, 16, 12, 40, seed=16)
    hs = heads.hidden.float().requires_grad_()
    out = fused_kl(hs, heads.weight.float(), heads.t_hidden.float(), heads.t_weight.float(),
                   backend="triton", options=SMALL_TILES)  # fmt: skip
    (g,) = torch.autograd.grad(out.sum(), hs, create_graph=True)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="double backward"):
        g.pow(2).sum().backward()
    assert "create_graph=True" in DOUBLE_BACKWARD


def _kl_fn(be: TritonBackend, direction: str) -> Any:
    def fn(hs: torch.Tensor, ws: torch.Tensor, ht: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        call = KLCall(
            hs, ws, ht, wt, torch.ones(hs.shape[0], dtype=torch.bool), 0.7, 1.2, direction
        )
        return be.kl(call).kl

    return fn


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_fullgraph_compile_matches_eager(compiler: str, direction: str) -> None:
    """Dynamo traces the two custom ops whole; the same kernels give the same bits."""
    torch._dynamo.reset()
    be = TritonBackend(TritonOptions(**SMALL_TILES, tma=True, backward_block_mib=1e-3))
    heads = Heads(24, 32, 20, 150, seed=17)
    inputs = [t.half() for t in (heads.hidden, heads.weight, heads.t_hidden, heads.t_weight)]

    def grads(fn: Any) -> list[torch.Tensor]:
        hs, ws = (t.clone().requires_grad_() for t in inputs[:2])
        out = fn(hs, ws, *inputs[2:])
        out.backward(heads.g.float())
        return [out.detach(), hs.grad, ws.grad]

    eager = grads(_kl_fn(be, direction))
    compiled = grads(torch.compile(_kl_fn(be, direction), fullgraph=True, backend=compiler))
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


def test_custom_ops_pass_opcheck() -> None:
    heads = Heads(8, 16, 12, 50, seed=18)
    key = TritonBackend(TritonOptions(**SMALL_TILES))._settings(torch.float32)[1]
    hs, ws = heads.hidden.float().requires_grad_(), heads.weight.float().requires_grad_()
    ht, wt = heads.t_hidden.float(), heads.t_weight.float()
    valid = heads.labels != IGNORE
    fwd = (hs, ws, ht, wt, valid, None, None, 1 / 0.7, 1.0, None, None, True, key)
    torch.library.opcheck(torch.ops.fusedhead_triton.kl_forward, fwd, test_utils=(
        "test_schema", "test_faketensor", "test_aot_dispatch_static",
    ))  # fmt: skip
    _, norm = torch.ops.fusedhead_triton.kl_forward(*fwd)
    coef = torch.where(valid, heads.g.float(), 0.0)
    bwd = (hs.detach(), ws.detach(), ht, wt, None, None, norm.detach(), coef,
           1 / 0.7, 1.0, None, None, True, key, False, True)  # fmt: skip
    torch.library.opcheck(torch.ops.fusedhead_triton.kl_backward, bwd,
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip
    dh, dw = torch.ops.fusedhead_triton.kl_backward(*bwd)
    assert dh.numel() == 0 and dw.shape == ws.shape
    # the normalisers: (row max, log s) in base 2 of each head, whose sum is its log-sum-exp
    want = torch.logsumexp(hs.detach().double() @ ws.detach().double().T / 0.7, -1)
    assert norm.shape == (5, hs.shape[0])
    assert rel_err(norm[:2].detach().double().sum(0) * math.log(2), want) <= 1e-6


@pytest.mark.slow
def test_the_kits_kl_property_passes_in_fp16() -> None:
    """test_triton_kit.py runs every property in fp32; the KL's in fp16 too (TMA loads)."""
    result = check_property("kl_accuracy", "triton", device="cpu", dtype="fp16")
    assert result.outcome is Outcome.PASS, result.line()
