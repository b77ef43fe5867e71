"""The hidden-gradient sum between vocabulary blocks (``sum_format``): exact fp32 as two int16
halves beside the output (``memory="fast"``, or nothing stashed), fp24 (a 16-bit significand,
one byte a value) exactly when stashed in dW's last rows (``memory="low"``, both gradients), no
split for fp32 outputs; and dz blocks in dW's unwritten rows.

CPU interpreter, fp16 and fp32 (bf16 dots are wrong under the interpreter; the bf16 layout is
pure torch and tested here too).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from triton_backend_helpers import (
    SMALL_TILES,
    SUM_UNIT,
    assert_close,
    assert_within_one_ulp,
    make_case,
    run_reference,
    run_triton,
    sum_slack,
)

from fusedhead_triton import schedule, sum_format
from fusedhead_triton.configs import BLOCK_BYTES, MAX_COLS

#: Vb = one 64-column tile: 6 vocabulary blocks at V = 333, so the sum spans several blocks.
MANY_BLOCKS: dict[str, Any] = {**SMALL_TILES, "backward_block_mib": 1e-4}
#: Upper bound on the blocks that add to dh at V = 333 (one more when the sum is stashed).
ADDS = 7
PATHS = ["pointer", "tma"]


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str | None, int | None]]:
    """Record (format, first stashed row) of every backward's sum."""
    seen: list[tuple[str | None, int | None]] = []
    real = sum_format.allocate

    def allocate(*args: Any) -> sum_format.DhSum:
        seen.append((args[5], args[6]))
        return real(*args)

    monkeypatch.setattr(sum_format, "allocate", allocate)
    return seen


def _spy_plans(monkeypatch: pytest.MonkeyPatch) -> list[list[schedule.Step]]:
    """Every plan the backward makes (a stashed one makes one without, then one with)."""
    seen: list[list[schedule.Step]] = []
    real = schedule.plan

    def plan(g: schedule.Geometry, **kwargs: Any) -> list[schedule.Step]:
        seen.append(real(g, **kwargs))
        return seen[-1]

    monkeypatch.setattr(schedule, "plan", plan)
    return seen


# --- the defects of the first layout, by construction -------------------------------------


def test_bf16_sum_stashed_in_rows_of_six_bytes() -> None:
    """bf16 (N, H, V) = (9, 3, 50000): the fp24 low part is 27 bytes, an odd count that no whole
    number of dW's 2-byte elements holds (the first layout took 13 elements, 26 bytes, and
    raised 'shape [9, 3] is invalid for input of size 26'). The view is the exact bytes, inside
    the lent rows, 16-byte aligned; writing it touches no byte below them."""
    n, h, v = 9, 3, 50000
    dw = torch.zeros((v, h), dtype=torch.bfloat16)
    first = sum_format.stash_row(dw, n * h)
    # 27 bytes need 5 rows of 6 bytes; 16-byte aligned starts are every 8 rows: row 49992
    assert first == 49992
    acc = sum_format.allocate(n, h, torch.bfloat16, dw.device, False, "fp24", first, dw)
    assert acc.lo.shape == (9, 3) and acc.lo.dtype == torch.int8 and acc.sum_lo == 8
    assert acc.hi.dtype == torch.int16 and acc.hi.data_ptr() == acc.out.data_ptr()
    start = acc.lo.data_ptr() - dw.data_ptr()
    assert start == first * h * 2 and start % 16 == 0 and start + 27 <= v * h * 2
    acc.lo.fill_(-1)
    raw = dw.view(-1).view(torch.uint8)
    assert int(raw[:start].sum()) == 0 and bool((raw[start : start + 27] == 255).all())
    assert int(raw[start + 27 :].sum()) == 0
    # and the plan the backward makes with that stash keeps its contract
    g = schedule.geometry(n, h, v, 2, 256, BLOCK_BYTES["low"], MAX_COLS)
    steps = schedule.plan(g, need_dw=True, need_dh=True, stash=first)
    assert sum(s.cols for s in steps if s.write_dw) == v
    assert sum(s.cols for s in steps if s.add_dh) == v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "h"), [(9, 3), (7, 5), (1, 1), (33, 17), (40, 64)])
def test_every_stashed_view_holds_its_bytes(dtype: torch.dtype, n: int, h: int) -> None:
    v = 1000
    dw = torch.empty((v, h), dtype=dtype)
    for fmt in ("fp24", "fp32"):
        low = sum_format.LOW_DTYPE[fmt]
        first = sum_format.stash_row(dw, n * h * low.itemsize)
        assert first is not None and (first * h * 2) % 16 == 0
        assert (v - first) * h * 2 >= n * h * low.itemsize
        acc = sum_format.allocate(n, h, dtype, dw.device, False, fmt, first, dw)
        assert acc.lo.shape == (n, h) and acc.lo.dtype == low


def test_no_stash_row_where_dw_is_too_small() -> None:
    dw = torch.empty((96, 48), dtype=torch.float16)
    assert sum_format.stash_row(dw, 200 * 48) is None  # 9600 bytes > 96 x 96
    assert sum_format.stash_row(dw, 96 * 96) == 0


@pytest.mark.parametrize("path", PATHS)
def test_a_frozen_weight_keeps_the_exact_sum(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """requires_grad=False on the weight: nothing is stashed, so the sum is exact fp32 (the
    first layout kept it in fp24 although nothing was stashed): the same bits as 'fast'."""
    case = make_case(40, 64, 333, seed=48)
    opts = {**MANY_BLOCKS, "tma": path == "tma"}
    seen = _spy(monkeypatch)
    low = run_triton(case, torch.float16, grad_weight=False, options={**opts, "memory": "low"})
    fast = run_triton(case, torch.float16, grad_weight=False, options={**opts, "memory": "fast"})
    assert seen == [("fp32", None), ("fp32", None)]
    assert low.d_weight is None
    assert torch.equal(low.d_hidden, fast.d_hidden)
    assert_close(low, run_reference(case, torch.float16), torch.float16)


# --- the formats, end to end ----------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_stashed_fp24_sum_within_its_precision(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """'low' stashes the fp24 sum in dW's last rows (40 x 64 x 1 bytes = 20 rows of 128 bytes):
    within one fp16 ulp of the exact 'fast' sum but for the sum's own rounding; the forward and
    the rows before the stash unchanged."""
    case = make_case(40, 64, 333, seed=21)
    opts = {**MANY_BLOCKS, "tma": path == "tma"}
    seen = _spy(monkeypatch)
    fast = run_triton(case, torch.float16, options={**opts, "memory": "fast"})
    low = run_triton(case, torch.float16, options={**opts, "memory": "low"})
    assert seen == [("fp32", None), ("fp24", 333 - 20)]
    assert torch.equal(low.log_probs, fast.log_probs) and torch.equal(low.entropy, fast.entropy)
    assert not torch.equal(low.d_hidden, fast.d_hidden)  # it does round
    slack = sum_slack(fast.d_hidden, ADDS, SUM_UNIT["fp24"])
    assert_within_one_ulp(low.d_hidden, fast.d_hidden, slack=slack)
    assert_within_one_ulp(low.d_weight, fast.d_weight)  # each row from its own dz
    assert_close(low, run_reference(case, torch.float16), torch.float16)


def test_stash_with_a_ragged_tail_and_softcap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of 50 x 2 bytes: the lent tail starts on a 16-byte boundary, not where it would fit."""
    case = make_case(30, 50, 333, seed=22, peak=3.0)
    seen = _spy(monkeypatch)
    got = run_triton(case, torch.float16, softcap=2.0, options=MANY_BLOCKS)
    fits = 333 - math.ceil(30 * 50 * 1 / 100)  # 318: the first row where 30 x 50 bytes fit
    first = max(r for r in range(fits + 1) if (r * 50 * 2) % 16 == 0)
    assert first == 316 and seen == [("fp24", first)]
    assert_close(got, run_reference(case, torch.float16, softcap=2.0), torch.float16)


def test_no_stash_where_dw_is_smaller_than_the_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 x 48 x 1 bytes > 96 x 48 x 2: not stashed, so not fp24 either: the exact halves."""
    case = make_case(200, 48, 96, seed=23)
    seen = _spy(monkeypatch)
    got = run_triton(case, torch.float16, options={**SMALL_TILES, "backward_block_mib": 1e-5})
    assert seen == [("fp32", None)]
    assert_close(got, run_reference(case, torch.float16), torch.float16)


def test_no_sum_format_for_fp32_or_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 sums straight into the fp32 output; a single block writes dh directly."""
    case = make_case(24, 48, 333, seed=43)
    seen = _spy(monkeypatch)
    got = run_triton(case, torch.float32, options=MANY_BLOCKS)
    one = run_triton(case, torch.float16, options=SMALL_TILES)  # 64 MiB: one block
    assert seen == [(None, None), (None, None)]
    assert_close(got, run_reference(case, torch.float32), torch.float32)
    assert_close(one, run_reference(case, torch.float16), torch.float16)


@pytest.mark.parametrize(
    ("memory", "need_dw", "need_dh", "mib"),
    [
        ("low", True, True, 64),  # the low-memory layout: dz mostly in dW's rows
        ("fast", True, True, 256),
        ("low", False, True, 256),  # no dW to lend or stash in (a frozen head)
        ("low", True, False, 256),  # no dh sum to stash
    ],
)
def test_the_dz_buffer_is_small_only_in_the_low_memory_layout(
    monkeypatch: pytest.MonkeyPatch, memory: str, need_dw: bool, need_dh: bool, mib: int
) -> None:
    budgets: list[int] = []
    real = schedule.geometry

    def geometry(*args: Any) -> schedule.Geometry:
        budgets.append(args[5])
        return real(*args)

    monkeypatch.setattr(schedule, "geometry", geometry)
    case = make_case(8, 32, 50, seed=49)
    run_triton(case, torch.float32, grad_hidden=need_dh, grad_weight=need_dw,
               options={**SMALL_TILES, "memory": memory})  # fmt: skip
    assert budgets == [mib * 2**20]


# --- dz blocks in dW's rows ------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_lent_rows_mean_fewer_blocks(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """N < H: dz blocks fit in dW's unwritten rows, wider than the buffer's: fewer additions
    to the sum than with every block in the buffer, and the same values up to its rounding."""
    case = make_case(24, 64, 333, seed=45)
    opts = {**MANY_BLOCKS, "tma": path == "tma", "memory": "fast"}
    plans = _spy_plans(monkeypatch)
    lent = run_triton(case, torch.float16, options=opts)
    frozen = run_triton(case, torch.float16, grad_weight=False, options=opts)
    assert any(s.dz_row is not None for s in plans[0])
    assert all(s.dz_row is None for s in plans[1])  # no dW, no rows to lend
    assert sum(s.add_dh for s in plans[0]) < sum(s.add_dh for s in plans[1])
    slack = sum_slack(frozen.d_hidden, ADDS, SUM_UNIT["fp32"])
    assert_within_one_ulp(lent.d_hidden, frozen.d_hidden, slack=slack)
    assert_close(lent, run_reference(case, torch.float16), torch.float16)


# --- the encoding, value by value -----------------------------------------------------------


#: The sum-format kernel module as built for this test's interpreter (a global: an interpreted
#: kernel sees its module's globals, not a closure).
_fmt: Any = None


def _roundtrip(x: torch.Tensor, sum_lo: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hi, lo, joined) of ``sum_split`` then ``sum_join`` on fp32 ``x``, through
    memory as the dh kernels store them (the kernel is made here, under the interpreter the
    test runs in)."""
    global _fmt
    from fusedhead_triton.kernels import sum_format as kernel_sum_format

    _fmt = kernel_sum_format

    @triton.jit
    def kernel(x_ptr, hi_ptr, lo_ptr, y_ptr, n, SUM_LO: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        hi, lo = _fmt.sum_split(x, SUM_LO)
        tl.store(hi_ptr + offs, hi, mask=mask)
        tl.store(lo_ptr + offs, lo, mask=mask)
        hi = tl.load(hi_ptr + offs, mask=mask, other=0)
        lo = tl.load(lo_ptr + offs, mask=mask, other=0)
        tl.store(y_ptr + offs, _fmt.sum_join(hi, lo, SUM_LO), mask=mask)

    hi = torch.empty(x.shape, dtype=torch.int16)
    lo = torch.empty(x.shape, dtype=torch.int16 if sum_lo == 16 else torch.int8)
    y = torch.empty_like(x)
    block = 1024
    kernel[(math.ceil(x.numel() / block),)](x, hi, lo, y, x.numel(), SUM_LO=sum_lo, BLOCK=block)
    return hi, lo, y


def _from_bits(*bits: int) -> torch.Tensor:
    return (
        torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits]).int().view(torch.float32)
    )


def _values() -> torch.Tensor:
    """Zeros, subnormals, normals of every scale both signs, the largest finite values, and
    halfway cases (the byte below the kept bits exactly 0x80)."""
    g = torch.Generator().manual_seed(44)
    special = _from_bits(
        0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00000080, 0x000000FF,  # subnormals
        0x00800000, 0x80800000, 0x3F800000, 0xBF800000, 0x3F7FFF80, 0xBF7FFF7F,  # normals
        0x3F800180, 0xBF800280, 0x7F7FFF7F, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000,  # ... inf
        0xFF800000,
    )  # fmt: skip
    scales = 2.0 ** torch.randint(-140, 120, (3000,), generator=g).double()
    normal = (torch.randn(3000, generator=g, dtype=torch.float64) * scales).float()
    raw = torch.randint(-(2**31), 2**31 - 1, (3000,), generator=g, dtype=torch.int64)
    raw = raw.int().view(torch.float32)  # every bit pattern: any byte below the kept bits
    return torch.cat([special, normal, raw[torch.isfinite(raw)]])


def _fp24_nearest(x: torch.Tensor) -> torch.Tensor:
    """x rounded to a 16-bit significand (ties away from zero), in float64 then fp32: a
    normal value's 2^(e - 16) steps, a subnormal's fixed 2^-141 (fp32's own 2^-149, x 256)."""
    x64 = x.double()
    _, e = torch.frexp(x64)  # x = m 2^e, 0.5 <= |m| < 1
    step = torch.exp2((e - 16).clamp_min(-141).double())
    q = torch.floor(x64.abs() / step + 0.5) * step
    return (torch.sign(x64) * q).float().where(x64 != 0, x)


def test_exact_halves_round_trip_every_bit_pattern() -> None:
    x = torch.cat([_values(), _from_bits(0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0x7F800001)])
    hi, lo, y = _roundtrip(x, 16)
    bits = x.view(torch.int32)
    assert torch.equal(y.view(torch.int32), bits)  # -0.0, subnormals, inf, NaN payloads too
    assert torch.equal(hi, (bits >> 16).short())  # the high half: what dh's buffer holds
    assert torch.equal(lo, (bits & 0xFFFF).short())


def test_fp24_rounds_to_the_nearest_16_bit_significand() -> None:
    x = _values()
    hi, _, y = _roundtrip(x, 8)
    want = _fp24_nearest(x)
    assert torch.equal(y.view(torch.int32), want.view(torch.int32))  # -0.0 included
    bits = y.view(torch.int32)
    assert torch.equal(bits & 0xFF, torch.zeros_like(bits))  # 24 bits kept, the rest zero
    assert torch.equal(hi, (bits >> 16).short())
    normal = torch.isfinite(y) & (x.abs() >= torch.finfo(torch.float32).tiny)
    rel = ((y.double() - x.double()).abs() / x.double().abs())[normal]
    assert float(rel.max()) <= 2.0**-16
    assert float(rel.max()) > 2.0**-17  # rounding to nearest spends its half step
    # halfway cases round the magnitude up (ties away from zero): 1 + 2^-16 -> 1 + 2^-15
    assert _roundtrip(_from_bits(0x3F800080, 0xBF800080), 8)[2].tolist() == [
        1 + 2.0**-15,
        -1 - 2.0**-15,
    ]
    # the largest finite values round past the largest 24-bit one: to inf, as IEEE does
    assert _roundtrip(_from_bits(0x7F7FFFFF, 0xFF7FFFFF), 8)[2].tolist() == [math.inf, -math.inf]


def test_fp24_keeps_a_nan_a_nan() -> None:
    x = _from_bits(0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF)
    y = _roundtrip(x, 8)[2]
    assert bool(torch.isnan(y).all()), y.tolist()
