"""Every GEMM goes through the dispatcher's ``aten::mm``; nothing ``[N, V]`` is made or saved."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch_backend_helpers import (
    Result,
    assert_close,
    make_case,
    rel_err,
    run_backend,
    run_reference,
)

import fusedhead.grad_sum as grad_sum
import fusedhead_torch.tile_math as tile_math
from fusedhead.protocol import call_backend
from fusedhead_torch import TorchBackend, TorchOptions
from fusedhead_torch.tiling import GRID_COLS

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
        ],
    ),
]


class MMOverride:
    """Replaces ``aten::mm`` on one dispatch key with ``scale * a @ b`` and records each call.

    The replacement computes through ``bmm`` (another operator), so it never calls itself.
    """

    def __init__(self, device: str) -> None:
        self.key = {"cpu": "CPU", "cuda": "CUDA"}[device]
        self.calls: list[tuple[int, int, int]] = []
        self._lib: torch.library.Library | None = None

    def install(self, scale: float = 1.0, overloads: tuple[str, ...] = ("mm",)) -> None:
        def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            self.calls.append((a.shape[0], a.shape[1], b.shape[1]))
            return torch.bmm(a.unsqueeze(0), b.unsqueeze(0)).squeeze(0).mul_(scale)

        def mm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
            self.calls.append((a.shape[0], a.shape[1], b.shape[1]))
            product = torch.bmm(a.unsqueeze(0).to(out_dtype), b.unsqueeze(0).to(out_dtype))
            return product.squeeze(0).mul_(scale)

        kernels = {"mm": mm, "mm.dtype": mm_dtype}
        self._lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch warns (once) that it overrides a kernel
            warnings.filterwarnings("ignore", "(?s).*Overriding a previously registered kernel")
            for name in overloads:
                self._lib.impl(name, kernels[name], self.key)

    def remove(self) -> None:
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None


@pytest.fixture
def mm_override(device: str) -> Iterator[MMOverride]:
    """An ``aten::mm`` override for ``device``, installed by the test, always removed after."""
    override = MMOverride(device)
    try:
        yield override
    finally:
        override.remove()


@pytest.mark.parametrize("device", DEVICES)
def test_an_aten_mm_override_steers_forward_and_backward(
    device: str, mm_override: MMOverride
) -> None:
    case = make_case(23, 16, 50)
    # Under "mm doubles", the backend computes the head of 2 W, as a function of W.
    want = run_reference(case, weight_scale=2.0)
    plain = run_reference(case)
    options = TorchOptions(chunk_rows=10, block_vocab=20, skip_ignored_rows=False)  # 3 x 3 tiles
    h = case.hidden.float().to(device).requires_grad_()
    w = case.weight.float().to(device).requires_grad_()
    mm_override.install(scale=2.0)
    lp, ent = call_backend(
        TorchBackend(options),
        h,
        w,
        case.labels.to(device),
        temperature=0.7,
        ignore_index=-100,
        return_entropy=True,
        process_group=None,
        vocab_start=0,
        vocab_size=50,
        reduce_hidden_grad=True,
    )
    forward_calls = len(mm_override.calls)
    loss = (lp.double() * case.g_lp.to(device)).sum() + (ent.double() * case.g_ent.to(device)).sum()
    loss.backward()
    backward_calls = len(mm_override.calls) - forward_calls
    mm_override.remove()
    assert forward_calls == 3  # one logits GEMM per grid tile: 3 row chunks x 1 (50 < GRID_COLS)
    assert backward_calls == 27  # recompute, dh and dW per tile
    got = Result(lp.detach().cpu(), ent.detach().cpu(), h.grad.cpu(), w.grad.cpu())
    assert_close(got, want, "fp32", "under the override")
    # ... and the override really changed the numbers.
    assert (got.log_probs - plain.log_probs).abs().max() > 0.1
    assert (got.d_hidden - plain.d_hidden).abs().max() > 0.1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_aten_mm_override_steers_the_fp32_logits_path(
    device: str, dtype: torch.dtype, mm_override: MMOverride
) -> None:
    # fp32 logits of low-precision inputs: aten::mm.dtype on CUDA, upcast + aten::mm elsewhere;
    # an override of both (the whole mm family) reaches every GEMM, forward and backward.
    case = make_case(23, 16, 50)
    want = run_reference(case, dtype=dtype, weight_scale=2.0)
    plain = run_reference(case, dtype=dtype)
    options = TorchOptions(
        chunk_rows=10, block_vocab=20, skip_ignored_rows=False, fp32_logits=True
    )  # 3 x 3 tiles
    # Its probe GEMM (cached per device, e.g. cuda:0) runs before the override counts calls.
    tile_math.mm_out_dtype_works(torch.empty(0, device=device).device, dtype)
    overloads = ("mm", "mm.dtype") if device == "cuda" else ("mm",)
    mm_override.install(scale=2.0, overloads=overloads)
    got = run_backend(case, dtype=dtype, device=device, options=options)
    calls = len(mm_override.calls)
    mm_override.remove()
    assert calls == 3 + 27  # forward: one logits GEMM per grid tile; backward: 3 per tile
    got = Result(got.log_probs.cpu(), got.entropy.cpu(), got.d_hidden.cpu(), got.d_weight.cpu())
    assert rel_err(got.log_probs, want.log_probs) <= 1e-5  # fp32 logits: fp32 bounds
    assert rel_err(got.entropy, want.entropy) <= 1e-5
    assert_close(got, want, {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype], "override")
    assert (got.log_probs - plain.log_probs).abs().max() > 0.1


@pytest.mark.parametrize("fp32_logits", [True, False], ids=["fp32-logits", "input-logits"])
def test_every_gemm_is_an_aten_mm(fp32_logits: bool) -> None:
    """Seen from the dispatcher (a TorchDispatchMode), each matrix product is an ``aten.mm``."""
    case = make_case(23, 16, 50)
    seen: set[str] = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.add(str(func))
            return func(*args, **(kwargs or {}))

    options = TorchOptions(chunk_rows=10, block_vocab=20, fp32_logits=fp32_logits)
    with Ops():
        run_backend(case, dtype=torch.bfloat16, options=options)
    products = {op for op in seen if any(k in op for k in ("mm", "matmul", "linear", "dot"))}
    assert products == {"aten.mm.default"}


@pytest.mark.parametrize("device", ["cpu"])
@pytest.mark.parametrize(
    ("grad_hidden", "grad_weight", "per_tile"),
    [(True, True, 3), (True, False, 2), (False, True, 2)],
    ids=["both", "hidden-only", "weight-only"],
)
def test_backward_computes_only_the_gradients_asked_for(
    mm_override: MMOverride, grad_hidden: bool, grad_weight: bool, per_tile: int
) -> None:
    case = make_case(20, 8, 30)
    options = TorchOptions(chunk_rows=10, block_vocab=15, skip_ignored_rows=False)  # 2 x 2 tiles
    h = case.hidden.float().requires_grad_(grad_hidden)
    w = case.weight.float().requires_grad_(grad_weight)
    mm_override.install()
    lp, ent = call_backend(
        TorchBackend(options),
        h,
        w,
        case.labels,
        temperature=0.7,
        ignore_index=-100,
        return_entropy=True,
        process_group=None,
        vocab_start=0,
        vocab_size=30,
        reduce_hidden_grad=True,
    )
    (lp.sum() + ent.sum()).backward()
    # forward: 2 row chunks x 1 grid tile (30 < GRID_COLS); backward: per_tile per 2 x 2 tile
    assert len(mm_override.calls) == 2 + 4 * per_tile
    assert (h.grad is not None) == grad_hidden and (w.grad is not None) == grad_weight


@pytest.mark.parametrize("device", ["cpu"])
def test_ignored_rows_are_left_out_of_the_gemms_when_skipping(mm_override: MMOverride) -> None:
    case = make_case(30, 8, 40, ignore_every=3)  # 10 of 30 rows ignored
    kept = int((case.labels != -100).sum())
    mm_override.install()
    got = run_backend(case, options=TorchOptions(skip_ignored_rows=True))
    mm_override.remove()
    rows_seen = {m for m, k, n in mm_override.calls if k == 8}  # logits GEMMs: [rows, H] @ [H, V]
    assert rows_seen == {kept}
    assert torch.equal(got.d_hidden[case.labels == -100], torch.zeros(10, 8))
    assert_close(got, run_reference(case), "fp32", "skipping ignored rows")


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_tokens_by_vocabulary_is_ever_made() -> None:
    n, h, v = 64, 8, 4 * GRID_COLS
    case = make_case(n, h, v)
    with _LargestTensor() as seen:
        run_backend(case, options=TorchOptions(block_vocab=64))
    # one forward (grid) tile, or the weight gradient
    assert seen.largest <= max(n * GRID_COLS, v * h)
    assert seen.largest < n * v


@pytest.mark.parametrize("skip", [False, True], ids=["all-rows", "skip-ignored"])
def test_forward_saves_only_inputs_and_per_row_vectors(skip: bool) -> None:
    n, h, v = 40, 8, 300
    case = make_case(n, h, v)
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_backend(case, options=TorchOptions(block_vocab=64, skip_ignored_rows=skip))
    # hidden (or its scored rows), the weight, and per-row vectors: nothing [N, V]-sized.
    extra = [s for s in shapes if s != (v, h) and not (len(s) == 2 and s[0] <= n and s[1] == h)]
    assert extra and all(len(s) == 1 and s[0] <= n for s in extra), shapes


def test_workspace_option_bounds_the_tile() -> None:
    backend = TorchBackend(TorchOptions(workspace_mib=1))
    tiles = backend.tiles(4096, 50_000, torch.float32, torch.device("cpu"))
    assert tiles.rows * tiles.cols * 8 <= 1 << 20
    assert tiles.cols >= 64


def test_the_out_dtype_route_of_fp32_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA route (``aten::mm.dtype``, no upcast copies), run on the CPU through a kernel
    registered for that overload here: every logits GEMM takes it, and the numbers are fp32's."""
    calls: list[tuple[torch.dtype, torch.dtype]] = []

    def mm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        calls.append((a.dtype, out_dtype))
        return torch.bmm(a.unsqueeze(0).to(out_dtype), b.unsqueeze(0).to(out_dtype)).squeeze(0)

    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("mm.dtype", mm_dtype, "CPU")
        monkeypatch.setattr(tile_math, "mm_out_dtype_works", lambda device, dtype: True)
        case = make_case(23, 16, 50)
        options = TorchOptions(
            chunk_rows=10, block_vocab=20, skip_ignored_rows=False, fp32_logits=True
        )  # 3 x 3 tiles
        got = run_backend(case, dtype=torch.bfloat16, options=options)
    finally:
        lib._destroy()
    # forward: 3 row chunks x 1 grid tile; backward recompute: 3 x 3 tiles
    assert calls == [(torch.bfloat16, torch.float32)] * (3 + 9)
    want = run_reference(case, dtype=torch.bfloat16)
    assert rel_err(got.log_probs, want.log_probs) <= 1e-5
    assert rel_err(got.entropy, want.entropy) <= 1e-5
    assert_close(got, want, "bf16", "mm.dtype route")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_check_runs_the_out_dtype_probe_eagerly(monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    """``check`` (eager, also when the core resolves a head inside torch.compile) fills the probe's
    cache, so a compiled call only reads it instead of retracing after the probe."""
    monkeypatch.setattr(tile_math, "_MM_OUT_DTYPE", {})
    cpu = torch.device("cpu")
    TorchBackend(TorchOptions()).check(cpu, dtype)
    monkeypatch.setattr(grad_sum, "_ADDMM_OUT_DTYPE", {})
    TorchBackend(TorchOptions()).check(cpu, dtype)
    probed = dict(tile_math._MM_OUT_DTYPE)
    assert probed == {(cpu, dtype): False}  # no aten::mm.dtype on the CPU
    probed = dict(grad_sum._ADDMM_OUT_DTYPE)
    assert probed == {(cpu, dtype): False}  # nor, so, its in-place aten::addmm.dtype_out
    TorchBackend(TorchOptions()).check(cpu, torch.float32)  # fp32 needs no probe
    assert list(tile_math._MM_OUT_DTYPE) == [(cpu, dtype)]


def test_the_policy_weight_gradient_sums_in_the_gemm_epilogue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The policy loss's CUDA route for a 16-bit weight gradient, run on the CPU through kernels
    registered for ``aten::mm.dtype`` and ``aten::addmm.dtype_out`` here: the probe passes, the
    first chunk writes the fp32 sum and every later one adds into it in place, and the gradient is
    the upcast route's bits (both sum the same fp32 products)."""
    import fusedhead

    calls: list[tuple[str, tuple[int, int]]] = []

    def mm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        calls.append(("mm", (a.shape[0], b.shape[1])))
        return torch.mm(a.to(out_dtype), b.to(out_dtype))

    def addmm_dtype_out(
        c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *,
        beta: float = 1, alpha: float = 1, out: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        calls.append(("addmm", (a.shape[0], b.shape[1])))
        assert out_dtype == torch.float32 and out.dtype == torch.float32
        return torch.addmm(c, a.to(out_dtype), b.to(out_dtype), beta=beta, alpha=alpha, out=out)

    g = torch.Generator().manual_seed(5)
    n, h, v = 40, 16, 50
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) / 4).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g)
    old, adv = torch.randn(n, generator=g) - 3, torch.randn(n, generator=g)

    def weight_grad() -> torch.Tensor:
        w = weight.clone().requires_grad_()
        out = fusedhead.fused_policy_loss(
            hidden, w, labels, old_log_probs=old, advantages=adv, backend="torch",
            temperature=0.7, options={"chunk_rows": 8, "compile_elementwise": False},
        )  # fmt: skip
        out.loss.backward()
        assert w.grad is not None and w.grad.dtype == torch.bfloat16
        return w.grad

    upcast = weight_grad()
    assert calls == []
    # mm.dtype is taken to work for the logits (its probe asks for CUDA); grad_sum's probe runs
    # its trials.
    monkeypatch.setattr(tile_math, "mm_out_dtype_works", lambda device, dtype: True)
    monkeypatch.setattr(grad_sum, "_ADDMM_OUT_DTYPE", {})
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("mm.dtype", mm_dtype, "CPU")
        lib.impl("addmm.dtype_out", addmm_dtype_out, "CPU")
        fused = weight_grad()
    finally:
        lib._destroy()
    probed = dict(grad_sum._ADDMM_OUT_DTYPE)
    assert probed == {(torch.device("cpu"), torch.bfloat16): True}
    # the probe's 2 x 2 trials, then 5 chunks of 8 rows, each a [8, V] fp32 logits GEMM and its
    # share of the [V, H] sum: the first written by mm, the 4 others added by addmm in place
    logits = ("mm", (8, v))
    assert calls[:2] == [("mm", (2, 2)), ("addmm", (2, 2))]
    assert calls[2:] == [logits, ("mm", (v, h))] + [logits, ("addmm", (v, h))] * 4
    assert torch.equal(fused, upcast)
