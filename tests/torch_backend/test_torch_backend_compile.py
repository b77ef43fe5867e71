"""``torch.compile(fullgraph=True, dynamic=False)`` through ``fused_head`` and ``FusedHead.kl`` on
the torch backend (CPU), forward and backward: the same values as eager, ignored rows exactly 0
(gradients too, even with NaN in their hidden state), the label, temperature and gather_ids
checks kept inside the graph; and eager still leaves ignored rows out of its GEMMs.

Inductor (the default) compiles the main cases; the variants of one trace (more tiles, per-token
temperature, softcap, the reverse KL) use ``aot_eager``, the same dynamo and AOTAutograd capture
with fullgraph, without inductor's C++ build (which takes most of this file's time on the CPU)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import fusedhead_torch.outputs as outputs_mod
from fusedhead import FusedHead, FusedHeadConfig, fused_head, fused_kl
from fusedhead.contract import EXTRA_FIELDS

N, H, V, HT = 40, 24, 384, 16
IGNORE = -100
IGNORED = slice(0, None, 5)  #: every fifth row is ignored
Outputs = dict[str, torch.Tensor]


def _inputs(
    seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (a NaN in one ignored row), weight, labels (every fifth ignored), all leaves."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[IGNORED] = IGNORE
    hidden[5] = float("nan")  # ignored: must reach neither an output nor a gradient
    return hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), labels


def _run(
    fn: Callable[..., Outputs], args: tuple[Any, ...], leaves: tuple[torch.Tensor, ...]
) -> tuple[Outputs, dict[str, tuple[torch.Tensor, ...]]]:
    """``fn``'s outputs, and per differentiable output the gradients of a random weighting of it."""
    out = fn(*args)
    grads = {}
    g = torch.Generator().manual_seed(1)
    for name, t in out.items():
        if t.requires_grad:
            upstream = torch.randn(t.shape, generator=g).to(t.device)
            loss = (t * upstream).sum()
            grads[name] = torch.autograd.grad(loss, leaves, retain_graph=True)
    return out, grads


def _compiled_matches_eager(
    fn: Callable[..., Outputs],
    args: tuple[Any, ...],
    leaves: tuple[torch.Tensor, ...],
    backend: str = "inductor",
) -> tuple[Outputs, dict[str, tuple[torch.Tensor, ...]]]:
    """Eager first (it resolves the head: see docs/configuration.md), then the compiled function;
    outputs and gradients within fp32 rounding, integer outputs and ignored rows exact."""
    want, want_g = _run(fn, args, leaves)
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
    got, got_g = _run(compiled, args, leaves)
    assert got.keys() == want.keys() and got_g.keys() == want_g.keys()
    for name, t in got.items():
        if t.is_floating_point():
            torch.testing.assert_close(t, want[name], msg=lambda m, n=name: f"{n}: {m}")
            assert bool(t[IGNORED].eq(0).all()), f"{name}: an ignored row is not 0"
        else:
            assert torch.equal(t, want[name]), f"{name}: compiled ids differ from eager"
    for name, grads in got_g.items():
        for leaf, a, b in zip(("hidden", "weight"), grads, want_g[name], strict=False):
            torch.testing.assert_close(a, b, msg=lambda m, n=name, x=leaf: f"d {x} of {n}: {m}")
            assert bool(a.isfinite().all()), f"d {leaf} of {name}: not finite"
        assert bool(grads[0][IGNORED].eq(0).all()), f"d hidden of {name}: ignored rows not 0"
    return got, got_g


#: The outputs a FusedHeadOutput can carry.
HEAD_OUTPUTS = ("log_probs", "entropy", *EXTRA_FIELDS)


def _head_outputs(o: Any) -> Outputs:
    """The outputs of a call that it was asked for, by name."""
    return {k: getattr(o, k) for k in HEAD_OUTPUTS if getattr(o, k) is not None}


# --- log-probs and entropy ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "dtype", "backend"),
    [
        (None, torch.float32, "inductor"),
        (None, torch.bfloat16, "inductor"),
        (
            {"skip_ignored_rows": True, "chunk_rows": 16, "block_vocab": 128},
            torch.float32,
            "aot_eager",
        ),
    ],
    ids=["fused_head-defaults", "fused_head-bf16", "FusedHead-skip-3x3-tiles"],
)
def test_log_probs_and_entropy_with_ignored_rows(
    options: dict[str, Any] | None, dtype: torch.dtype, backend: str
) -> None:
    """fp32 outputs within fp32 rounding of eager; gradients in the input dtype within its own."""
    hidden, weight, labels = _inputs(dtype=dtype)
    if options is None:

        def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Outputs:
            o = fused_head(h, w, y, backend="torch", temperature=0.7, check_labels=False)
            return {"log_probs": o.log_probs, "entropy": o.entropy}
    else:
        head = FusedHead(FusedHeadConfig(backend="torch", options=options, check_labels=False))

        def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Outputs:
            o = head(h, w, y, temperature=0.7)
            return {"log_probs": o.log_probs, "entropy": o.entropy}

    _compiled_matches_eager(fn, (hidden, weight, labels), (hidden, weight), backend)


def test_per_token_temperature() -> None:
    hidden, weight, labels = _inputs(seed=2)
    temp = torch.rand(N, generator=torch.Generator().manual_seed(3)) + 0.3

    def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> Outputs:
        o = fused_head(h, w, y, backend="torch", temperature=t, check_labels=False)
        return {"log_probs": o.log_probs, "entropy": o.entropy}

    _compiled_matches_eager(fn, (hidden, weight, labels, temp), (hidden, weight))


def test_softcap() -> None:
    hidden, weight, labels = _inputs(seed=4)
    with torch.no_grad():
        weight.mul_(8)  # logits well past the cap, where tanh bends

    def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Outputs:
        o = fused_head(h, w, y, temperature=0.8, softcap=4.0, check_labels=False)
        return {"log_probs": o.log_probs, "entropy": o.entropy}

    _compiled_matches_eager(fn, (hidden, weight, labels), (hidden, weight), "aot_eager")


# --- the declared extras ------------------------------------------------------------------------


def test_every_extra_output() -> None:
    """top-k (ids exact, ties by the lower id: every logit appears twice), gather (some ids
    ignored), lse, sum_p2, argmax; each differentiable output's gradients on their own."""
    hidden, weight, labels = _inputs(seed=5)
    with torch.no_grad():
        weight[V // 2 :] = weight[: V // 2]  # id i and i + V/2 tie on every row
    ids = torch.randint(0, V, (N, 3), generator=torch.Generator().manual_seed(6))
    ids[1::3, 1] = IGNORE

    def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> Outputs:
        o = fused_head(
            h,
            w,
            y,
            temperature=0.9,
            check_labels=False,
            top_k=5,
            gather_ids=g,
            return_lse=True,
            return_sum_p2=True,
            return_argmax=True,
        )
        return _head_outputs(o)

    got, grads = _compiled_matches_eager(fn, (hidden, weight, labels, ids), (hidden, weight))
    assert set(got) == set(HEAD_OUTPUTS)
    assert set(grads) == {"log_probs", "entropy", "lse", "sum_p2", "topk_log_probs", "gathered"}
    scored = labels != IGNORE
    top = got["topk_ids"][scored]  # pairs (i, i + V/2), then the 5th: the lower id of its pair
    assert bool((top[:, ::2] < V // 2).all()), "a tie went to the higher id"
    assert torch.equal(top[:, 1::2], top[:, 0:4:2] + V // 2)
    assert torch.equal(got["argmax"][scored], top[:, 0])


def test_tie_resolution_in_fixed_shapes_is_the_eager_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``block_topk``'s compiled branch (every row the exact way) against its eager one, on tiles
    full of ties at the k-th value (small integers), for k from 1 to past the tile's width."""
    g = torch.Generator().manual_seed(7)
    tiles = [torch.randint(0, 4, (33, 50), generator=g).float() for _ in range(3)]
    tiles.append(torch.randn(33, 50, generator=g))
    for x in tiles:
        for k in (1, 2, 7, 49, 50, 64):
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
            want = outputs_mod.block_topk(x, k)
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
            got = outputs_mod.block_topk(x, k)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), k


# --- the KL of two heads ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("direction", "backend"), [("forward", "inductor"), ("reverse", "aot_eager")]
)
def test_kl(direction: str, backend: str) -> None:
    hidden, weight, labels = _inputs(seed=8)
    g = torch.Generator().manual_seed(9)
    t_hidden, t_weight = torch.randn(N, HT, generator=g), torch.randn(V, HT, generator=g) / 4
    t_hidden[5] = float("inf")  # the NaN row's teacher: ignored as well
    temp = torch.rand(N, generator=g) + 0.5
    head = FusedHead(FusedHeadConfig(backend="torch", options={"block_vocab": 128}))

    def fn(
        h: torch.Tensor, w: torch.Tensor, th: torch.Tensor, tw: torch.Tensor, y: torch.Tensor
    ) -> Outputs:
        kl = head.kl(h, w, th, tw, y, direction=direction, temperature=temp, softcap=6.0)
        plain = fused_kl(h, w, th, tw, y, direction=direction, teacher_temperature=0.8)
        return {"kl": kl, "kl_plain": plain}

    got, _ = _compiled_matches_eager(
        fn, (hidden, weight, t_hidden, t_weight, labels), (hidden, weight), backend
    )
    assert bool((got["kl"][labels != IGNORE] > 0).all())


# --- the checks under compile: in the graph, not skipped -----------------------------------------


def test_checks_stay_in_the_compiled_graph() -> None:
    """check_labels=True (the default) compiles with fullgraph; the same graph, rerun with a bad
    label, a zero temperature or a bad gather id, raises eager's ValueError (value, position)."""
    hidden, weight, labels = _inputs(seed=10)
    temp = torch.full((N,), 0.7)
    ids = torch.randint(0, V, (N, 2), generator=torch.Generator().manual_seed(11))

    def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> Outputs:
        o = fused_head(h, w, y, temperature=t)
        return {"log_probs": o.log_probs, "entropy": o.entropy}

    def fn_ids(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> Outputs:
        return {"gathered": fused_head(h, w, y, gather_ids=g).gathered}

    _compiled_matches_eager(fn, (hidden, weight, labels, temp), (hidden, weight))
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    bad = labels.clone()
    bad[3] = V
    message = rf"labels must be in \[0, {V}\) or ignore_index=-100, got {V} at flat position 3"
    for run in (fn, compiled):
        with pytest.raises(ValueError, match=message):
            run(hidden, weight, bad, temp)
    cold = temp.clone()
    cold[7] = 0.0
    with pytest.raises(ValueError, match="temperature tensor must hold finite values > 0"):
        compiled(hidden, weight, labels, cold)
    compiled(hidden, weight, labels, temp)  # the good inputs still pass

    _compiled_matches_eager(fn_ids, (hidden, weight, labels, ids), (hidden, weight))
    ids[2, 1] = -1  # row 2 is scored
    with pytest.raises(
        ValueError, match=rf"gather_ids must be in \[0, {V}\).* got -1 at flat row 2"
    ):
        torch.compile(fn_ids, fullgraph=True, dynamic=False)(hidden, weight, labels, ids)


def test_teacher_temperature_named_in_the_compiled_graph() -> None:
    hidden, weight, labels = _inputs(seed=13)
    t_hidden, t_weight = torch.randn(N, HT), torch.randn(V, HT)

    def fn(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return fused_kl(h, w, t_hidden, t_weight, labels, teacher_temperature=t)

    temp = torch.full((N,), 0.5)
    eager = fn(hidden, weight, temp)
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(hidden, weight, temp), eager)
    temp[1] = float("inf")
    for run in (fn, compiled):
        with pytest.raises(ValueError, match=r"^teacher_temperature tensor must hold finite"):
            run(hidden, weight, temp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_on_cuda(dtype: torch.dtype) -> None:
    """The same capture on CUDA (rows always masked there), inductor's Triton kernels: every
    output and the KL, per-token temperature, softcap, ignored rows (one with NaN); the compiled
    step's check raises eager's ValueError."""
    h_cpu, w_cpu, y_cpu = _inputs(seed=14, dtype=dtype)
    hidden = h_cpu.detach().cuda().requires_grad_()
    weight = w_cpu.detach().cuda().requires_grad_()
    labels = y_cpu.cuda()
    g = torch.Generator().manual_seed(15)
    temp = (torch.rand(N, generator=g) + 0.5).cuda()
    ids = torch.randint(0, V, (N, 3), generator=g).cuda()
    t_hidden = torch.randn(N, HT, generator=g).to("cuda", dtype)
    t_weight = (torch.randn(V, HT, generator=g) / 4).to("cuda", dtype)

    def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> Outputs:
        o = fused_head(
            h,
            w,
            y,
            temperature=t,
            softcap=5.0,
            top_k=4,
            gather_ids=ids,
            return_lse=True,
            return_sum_p2=True,
            return_argmax=True,
        )
        kl = fused_kl(h, w, t_hidden, t_weight, y, direction="reverse", temperature=t)
        return {**_head_outputs(o), "kl": kl}

    _compiled_matches_eager(fn, (hidden, weight, labels, temp), (hidden, weight))
    bad = labels.clone()
    bad[3] = -7
    with pytest.raises(ValueError, match=r"got -7 at flat position 3"):
        torch.compile(fn, fullgraph=True, dynamic=False)(hidden, weight, bad, temp)


# --- eager keeps its speed path, and masking gives its bits -------------------------------------


class _MmRows(TorchFunctionMode):
    """Records the row count of every ``torch.mm``'s first operand."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.mm:
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@contextmanager
def _mm_rows() -> Iterator[list[int]]:
    mode = _MmRows()
    with mode:
        yield mode.rows


def test_eager_still_leaves_ignored_rows_out_and_masking_gives_the_same_bits() -> None:
    """CPU eager, default options: the logits GEMMs see only the scored rows (the speed path);
    with ``skip_ignored_rows=False`` (what compile does) the scored rows get the same bits, for
    the head, the extras and the KL (fp32, shapes whose GEMM bits do not depend on the row count)."""
    hidden, weight, labels = _inputs(seed=12)
    scored = int((labels != IGNORE).sum())
    masked = FusedHead(FusedHeadConfig(backend="torch", options={"skip_ignored_rows": False}))
    t_hidden, t_weight = torch.randn(N, HT), torch.randn(V, HT)
    keep = labels != IGNORE

    def all_outputs(head: Any) -> list[torch.Tensor]:
        o = head(hidden, weight, labels, temperature=0.7, top_k=3, return_lse=True)
        kl = head.kl(hidden, weight, t_hidden, t_weight, labels, direction="reverse")
        plain = head(hidden, weight, labels, temperature=0.7)
        ts = [*_head_outputs(o).values(), kl, *_head_outputs(plain).values()]
        loss = sum((t * (i + 1)).sum() for i, t in enumerate(ts) if t.requires_grad)
        assert isinstance(loss, torch.Tensor)
        return [*ts, *torch.autograd.grad(loss, (hidden, weight))]

    default = FusedHead(FusedHeadConfig(backend="torch"))  # skip_ignored_rows: None
    with _mm_rows() as rows:
        default(hidden, weight, labels, temperature=0.7)
    assert rows and set(rows) == {scored}, rows  # every logits GEMM: the scored rows only
    want = all_outputs(default)
    got = all_outputs(masked)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a.shape[:1] == (N,) and a.shape != weight.shape:
            a, b = a[keep], b[keep]
        assert torch.equal(a, b), f"output {i}: masked rows differ from skipped ones"
