"""``dh_sum``: how the hidden-gradient running sum is kept between vocabulary blocks (an fp32
buffer; exact fp32 as two 16-bit halves; fp24, rounded to a 16-bit significand), and
``lend_dw_rows``: dz blocks kept in weight-gradient rows not written yet, for fewer, wider blocks.

CPU interpreter, fp16 and fp32 (bf16 dots are wrong under the interpreter).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from pydantic import ValidationError
from triton_backend_helpers import (
    SMALL_TILES,
    SUM_UNIT,
    assert_close,
    assert_within_one_ulp,
    make_case,
    run_reference,
    run_triton,
)

from fusedhead_triton import TritonOptions, launch, schedule
from fusedhead_triton import backend as backend_mod
from fusedhead_triton.configs import BackendConfigs

#: Vb = one 64-column tile: 6 vocabulary blocks at V = 333, so the sum spans several blocks.
MANY_BLOCKS: dict[str, Any] = {**SMALL_TILES, "backward_block_mib": 1e-4}
#: Nothing stashed, nothing lent, unless a test asks (whatever the defaults are).
PLAIN: dict[str, Any] = {**MANY_BLOCKS, "stash_dh_sum": False, "lend_dw_rows": False}
#: Upper bound on the blocks that add to dh at V = 333 (one more when the sum is stashed).
ADDS = 7
PATHS = ["pointer", "tma", "tma-sum"]


def _options(monkeypatch: pytest.MonkeyPatch, path: str, **more: Any) -> dict[str, Any]:
    """MANY_BLOCKS through pointers, TMA loads, or TMA loads and a sum read and written through
    TMA descriptors (over the int16 / int8 halves too)."""
    if path == "tma-sum":
        pick = backend_mod.default_configs

        def with_tma_sum(dtype: torch.dtype) -> BackendConfigs:
            base = pick(dtype)
            return replace(base, dh=replace(base.dh, tma_sum=True))

        monkeypatch.setattr(backend_mod, "default_configs", with_tma_sum)
    return {**PLAIN, "tma": path != "pointer", **more}


def _spy_layouts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype | None, int]]:
    """Record (dtype of the sum's own buffer, SUM_LO) of every backward."""
    seen: list[tuple[torch.dtype | None, int]] = []
    real = launch._sum_layout

    def spy(*args: Any, **kwargs: Any) -> tuple[torch.dtype | None, int]:
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(launch, "_sum_layout", spy)
    return seen


def _spy_plans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, list[schedule.Step]]]:
    """Record (lend_rows, steps) of every schedule made (a stashed backward makes two: the
    second, with the stash, is the one it runs)."""
    seen: list[tuple[bool, list[schedule.Step]]] = []
    real = schedule.plan

    def spy(g: schedule.Geometry, **kwargs: Any) -> list[schedule.Step]:
        steps = real(g, **kwargs)
        seen.append((kwargs["lend_rows"], steps))
        return steps

    monkeypatch.setattr(launch.schedule, "plan", spy)
    return seen


def _adds(steps: list[schedule.Step]) -> int:
    return sum(s.add_dh for s in steps)


# --- the formats, end to end ----------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_exact_fp32_halves_give_the_fp32_buffers_sum(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """fp16: 'pair' keeps an fp32 buffer, 'fp32' the same fp32 value in two int16 halves (the
    high one in dh's own buffer): the same sums in the same order, the same bits."""
    case = make_case(40, 64, 333, seed=41)
    opts = _options(monkeypatch, path)
    layouts = _spy_layouts(monkeypatch)
    plain = run_triton(case, torch.float16, options={**opts, "dh_sum": "pair"})
    halves = run_triton(case, torch.float16, options={**opts, "dh_sum": "fp32"})
    assert layouts == [(torch.float32, 0), (torch.int16, 16)]
    assert torch.equal(halves.d_hidden, plain.d_hidden)
    assert torch.equal(halves.d_weight, plain.d_weight)
    assert torch.equal(halves.log_probs, plain.log_probs)
    assert_close(halves, run_reference(case, torch.float16), torch.float16)


@pytest.mark.parametrize("path", PATHS)
def test_fp24_sum_rounds_within_its_precision(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """fp24 rounds the running sum to a 16-bit significand at each block: within one fp16 ulp
    of the exact sum, but for values that cancel to far less than the partial sums."""
    case = make_case(40, 64, 333, seed=42)
    opts = _options(monkeypatch, path)
    layouts = _spy_layouts(monkeypatch)
    exact = run_triton(case, torch.float16, options={**opts, "dh_sum": "fp32"})
    fp24 = run_triton(case, torch.float16, options={**opts, "dh_sum": "fp24"})
    assert layouts == [(torch.int16, 16), (torch.int8, 8)]
    assert not torch.equal(fp24.d_hidden, exact.d_hidden)  # it does round
    slack = ADDS * SUM_UNIT["fp24"] * float(exact.d_hidden.abs().max())
    assert_within_one_ulp(fp24.d_hidden, exact.d_hidden, slack=slack)
    assert torch.equal(fp24.d_weight, exact.d_weight)
    assert_close(fp24, run_reference(case, torch.float16), torch.float16)


@pytest.mark.parametrize("dh_sum", ["fp32", "fp24"])
def test_fp32_inputs_sum_in_the_output_whatever_the_format(
    monkeypatch: pytest.MonkeyPatch, dh_sum: str
) -> None:
    case = make_case(24, 48, 333, seed=43)
    layouts = _spy_layouts(monkeypatch)
    plain = run_triton(case, torch.float32, options={**PLAIN, "dh_sum": "pair"})
    got = run_triton(case, torch.float32, options={**PLAIN, "dh_sum": dh_sum})
    assert layouts == [(None, 0), (None, 0)]
    assert torch.equal(got.d_hidden, plain.d_hidden)


# --- the encoding, value by value -----------------------------------------------------------


#: The backward kernel module as built for this test's interpreter (a global: an interpreted
#: kernel sees its module's globals, not a closure).
_bwd: Any = None


def _roundtrip(x: torch.Tensor, sum_lo: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hi, lo, joined) of ``backward._sum_split`` then ``_sum_join`` on fp32 ``x``, through
    memory as the dh kernels store them (the kernel is made here, under the interpreter the
    test runs in)."""
    global _bwd
    _, _bwd = launch.kernels()

    @triton.jit
    def kernel(x_ptr, hi_ptr, lo_ptr, y_ptr, n, SUM_LO: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        hi, lo = _bwd._sum_split(x, hi_ptr.dtype.element_ty, lo_ptr.dtype.element_ty, SUM_LO)
        tl.store(hi_ptr + offs, hi, mask=mask)
        tl.store(lo_ptr + offs, lo, mask=mask)
        hi = tl.load(hi_ptr + offs, mask=mask, other=0)
        lo = tl.load(lo_ptr + offs, mask=mask, other=0)
        tl.store(y_ptr + offs, _bwd._sum_join(hi, lo, SUM_LO), mask=mask)

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


# --- dz blocks in dW's rows ------------------------------------------------------------------


@pytest.mark.parametrize("stash", [False, True], ids=["fp32-buffer", "stashed-fp24"])
@pytest.mark.parametrize("path", PATHS)
def test_lending_dw_rows_keeps_the_values_with_fewer_blocks(
    monkeypatch: pytest.MonkeyPatch, path: str, stash: bool
) -> None:
    case = make_case(40, 64, 333, seed=45)
    opts = _options(monkeypatch, path, stash_dh_sum=stash, dh_sum="fp24" if stash else "pair")
    plans = _spy_plans(monkeypatch)
    plain = run_triton(case, torch.float16, options=opts)
    lent = run_triton(case, torch.float16, options={**opts, "lend_dw_rows": True})
    # the plans run: the last of each backward (a stashed one makes one without, one with)
    ran = {lend: steps for lend, steps in plans}
    assert any(s.dz_row is not None for s in ran[True])
    assert not any(s.dz_row is not None for s in ran[False])
    assert _adds(ran[True]) < _adds(ran[False])
    assert torch.equal(lent.log_probs, plain.log_probs)
    assert torch.equal(lent.entropy, plain.entropy)
    # other block edges, so other partial sums: one ulp but for the sum's own rounding
    unit = SUM_UNIT["fp24" if stash else "fp32"]
    slack = ADDS * unit * float(plain.d_hidden.abs().max())
    assert_within_one_ulp(lent.d_hidden, plain.d_hidden, slack=slack)
    assert_within_one_ulp(lent.d_weight, plain.d_weight)  # each row from its own dz, one GEMM
    assert_close(lent, run_reference(case, torch.float16), torch.float16)


def test_lending_without_the_weight_gradient_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without dW there are no rows to lend: the buffer's blocks, the same bits."""
    case = make_case(40, 64, 333, seed=46)
    plans = _spy_plans(monkeypatch)
    plain = run_triton(case, torch.float16, grad_weight=False, options=PLAIN)
    lent = run_triton(
        case, torch.float16, grad_weight=False, options={**PLAIN, "lend_dw_rows": True}
    )
    assert [lend for lend, _ in plans] == [False, True]
    assert plans[1][1] == plans[0][1]
    assert all(s.dz_row is None and not s.write_dw and s.add_dh for s in plans[1][1])
    assert lent.d_weight is None
    assert torch.equal(lent.d_hidden, plain.d_hidden)
    assert_close(lent, run_reference(case, torch.float16), torch.float16)


def test_fp24_sum_through_tma_descriptors_with_rows_of_40(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = make_case(40, 40, 333, seed=47)
    opts = _options(monkeypatch, "tma-sum", dh_sum="fp24")
    got = run_triton(case, torch.float16, options=opts)
    assert_close(got, run_reference(case, torch.float16), torch.float16)


# --- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"), [("dh_sum", "bogus"), ("dh_sum", "fp16"), ("lend_dw_rows", "sometimes")]
)
def test_options_reject_unknown_values(name: str, value: str) -> None:
    with pytest.raises(ValidationError, match=name):
        TritonOptions(**{name: value})


def test_options_take_every_format() -> None:
    assert TritonOptions().dh_sum == "auto"
    for fmt in launch.SUM_FORMATS:
        o = TritonOptions(dh_sum=fmt, lend_dw_rows=True)
        assert (o.dh_sum, o.lend_dw_rows) == (fmt, True)
    assert set(launch.SUM_FORMATS) == {"pair", "fp32", "fp24"}


@pytest.mark.parametrize(
    ("lend", "stash", "need_dw", "need_dh", "mib"),
    [
        (True, True, True, True, 64),  # the low-memory layout: dz mostly in dW's rows
        (True, False, True, True, 256),  # the sum not stashed: speed over memory
        (False, True, True, True, 256),  # no lent rows: the buffer holds every block
        (True, True, False, True, 256),  # no dW to lend (a frozen head)
        (True, True, True, False, 256),  # no dh sum to stash
    ],
)
def test_the_dz_buffer_is_small_only_in_the_low_memory_layout(
    lend: bool, stash: bool, need_dw: bool, need_dh: bool, mib: int
) -> None:
    assert launch.default_block_bytes(lend, stash, need_dw, need_dh) == mib * 2**20
