"""``schedule.plan``: the backward's vocabulary blocks in order, and where each block's dz lives.

Pure Python, no kernels. The contract: every vocabulary row adds to dh once and writes dW once
(as asked), a dz block lent from dW sits only in rows that nothing has written yet and that do
not hold the stashed dh sum while it lives, and lending never adds read-modify-writes of the sum
(against every block in the buffer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusedhead_triton.schedule import Geometry, Step, geometry, plan, rows_needed


def _round_up(x: int, q: int) -> int:
    return -(-x // q) * q


def _dz_rows(g: Geometry, stride: int) -> int:
    """dW rows under a dz block of ``stride`` columns: N x stride values of dW's dtype."""
    return _round_up(g.n * stride, g.h) // g.h


@dataclass(frozen=True)
class Call:
    g: Geometry
    need_dw: bool
    need_dh: bool
    stash: int | None

    def steps(self) -> list[Step]:
        return plan(self.g, need_dw=self.need_dw, need_dh=self.need_dh, stash=self.stash)

    def buffer_adds(self) -> int:
        """Read-modify-writes of the sum with every block in the buffer."""
        if not self.need_dh:
            return 0
        stashed = self.stash is not None and self.need_dw
        ranges = [self.stash, self.g.v - self.stash] if stashed else [self.g.v]
        return sum(math.ceil(r / self.g.buffer_cols) for r in ranges if r)


@st.composite
def calls(draw: st.DrawFn) -> Call:
    align = draw(st.sampled_from([16, 64, 256]))
    # narrow buffers as often as not: that is where lending dW's rows matters
    buffer_cols = align * draw(st.one_of(st.integers(1, 2048 // align), st.integers(1, 4)))
    # max_cols: aligned, or any width
    max_cols = draw(
        st.one_of(
            st.integers(buffer_cols // align, 8192 // align).map(lambda k: k * align),
            st.integers(buffer_cols, 8192),
        )
    )
    v = draw(st.integers(1, 3000))
    h = draw(st.integers(1, 600))
    # N up to a few H as often as not: dz blocks fit in dW's free rows (n / h rows a column)
    n = draw(st.one_of(st.integers(1, 5000), st.integers(1, min(5000, 3 * h))))
    g = Geometry(
        n=n,
        h=h,
        v=v,
        align=align,
        buffer_cols=buffer_cols,
        max_cols=max_cols,
        row_quantum=draw(st.sampled_from([1, 2, 4, 8])),
    )
    # both gradients (where the stash applies) half the time
    need_dw, need_dh = draw(
        st.sampled_from([(True, True), (True, True), (True, False), (False, True)])
    )
    # anywhere, or dW's last rows (launch stashes the sum in as few as hold it)
    stash = draw(st.one_of(st.none(), st.integers(0, v - 1), st.integers(v - v // 4 - 1, v - 1)))
    return Call(g, need_dw, need_dh, stash)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def check_plan(c: Call, steps: list[Step]) -> None:
    """Every invariant of the contract, for one call."""
    g = c.g
    stashed = c.stash is not None and c.need_dw and c.need_dh  # plan ignores it otherwise
    tail = c.stash if stashed else g.v
    assert tail is not None
    lend = c.need_dw and g.h > 0

    # every row: added to dh once iff asked, written to dW once iff asked
    adds, writes = [0] * g.v, [0] * g.v
    for s in steps:
        assert s.write_dw or s.add_dh, s  # no dz computed for nothing
        assert s.v0 >= 0 and s.v0 + s.cols <= g.v, s
        for r in range(s.v0, s.v0 + s.cols):
            adds[r] += s.add_dh
            writes[r] += s.write_dw
    assert adds == [int(c.need_dh)] * g.v
    assert writes == [int(c.need_dw)] * g.v

    # the three phases, in order, each a run of consecutive blocks over its rows
    dh_only = [i for i, s in enumerate(steps) if s.add_dh and not s.write_dw and s.v0 >= tail]
    write_only = [i for i, s in enumerate(steps) if s.write_dw and not s.add_dh and s.v0 >= tail]
    main = [i for i, s in enumerate(steps) if s.v0 < tail]
    assert sorted(dh_only + write_only + main) == list(range(len(steps)))
    if stashed:
        assert dh_only == list(range(len(dh_only)))  # first
        assert main == list(range(len(dh_only), len(dh_only) + len(main)))
        assert all(not steps[i].add_dh for i in write_only)
    else:
        assert dh_only == [] and write_only == []
    last_add = max((i for i, s in enumerate(steps) if s.add_dh), default=-1)
    assert all(i > last_add for i in write_only)
    for phase, end in ((dh_only, g.v), (main, tail), (write_only, g.v)):
        v0 = steps[phase[0]].v0 if phase else end
        for i in phase:
            assert steps[i].v0 == v0, (i, steps[i])  # fixed order: consecutive, ascending
            v0 += steps[i].cols
        assert v0 == end

    written: list[tuple[int, int]] = []  # dW rows written so far
    for i, s in enumerate(steps):
        end = tail if s.v0 < tail else g.v  # end of this block's range
        remaining = end - s.v0
        assert s.cols >= 1
        assert s.stride == _round_up(s.cols, g.align)
        if g.max_cols % g.align == 0 and s.v0 + s.cols < end:
            assert s.cols % g.align == 0, s  # only a range's last block is ragged
        own = (s.v0, s.v0 + s.cols)
        if s.dz_row is None:
            assert s.cols == min(g.buffer_cols, remaining), s
            if lend:  # the buffer only where even a buffer-wide block has no free rows
                lo, hi = (own[1], tail if s.add_dh else g.v) if s.write_dw else (0, tail)
                start = _round_up(lo, g.row_quantum)
                assert start + _dz_rows(g, _round_up(s.cols, g.align)) > hi, s
        else:
            assert lend, s
            assert min(g.buffer_cols, remaining) <= s.cols <= g.max_cols, s
            assert s.dz_row % g.row_quantum == 0, s
            rows = (s.dz_row, s.dz_row + _dz_rows(g, s.stride))
            assert rows_needed(g, s.stride) == rows[1] - rows[0]
            assert rows[0] >= 0 and rows[1] <= g.v, s
            if s.write_dw:  # dW[v0:v0+cols] is written from this dz: apart from it
                assert not _overlaps(rows, own), s
            for w in written:
                assert not _overlaps(rows, w), (s, w)
            if stashed and i <= last_add:  # the sum lives in [stash, v) until its last add
                assert rows[1] <= tail, s
        if s.write_dw:
            written.append(own)


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(calls())
def test_plan_keeps_its_contract(c: Call) -> None:
    steps = c.steps()
    check_plan(c, steps)
    assert sum(s.add_dh for s in steps) <= c.buffer_adds()
    assert c.steps() == steps  # a pure function of its arguments


def test_large_vocabulary_lends_wide_early_blocks() -> None:
    """N 32768, H 4096, V 151936 bf16, 64 MiB dz buffer (1024 columns), the fp24 sum stashed
    in dW's last 16384 rows (32768 x 4096 x 1 bytes over rows of 8192 bytes)."""
    v = 151936
    g = Geometry(32768, 4096, v, align=256, buffer_cols=1024, max_cols=8192, row_quantum=1)
    stash = v - 16384
    steps = plan(g, need_dw=True, need_dh=True, stash=stash)
    check_plan(Call(g, True, True, stash), steps)
    # the stashed rows add to dh first, 8192 wide, their dz at dW's top
    assert steps[0] == Step(stash, 8192, 8192, 0, write_dw=False, add_dh=True)
    assert steps[1] == Step(stash + 8192, 8192, 8192, 0, write_dw=False, add_dh=True)
    # then the main rows, 8192 wide while the free rows beyond them hold their dz
    assert steps[2] == Step(0, 8192, 8192, 8192, write_dw=True, add_dh=True)
    assert all(s.cols == 8192 and s.dz_row is not None for s in steps[:8])
    adds = sum(s.add_dh for s in steps)
    assert adds < 45
    buffer_only = Call(g, True, True, stash).buffer_adds()
    assert buffer_only == math.ceil(16384 / 1024) + math.ceil(stash / 1024) >= 149  # ~150 RMWs


def test_small_plan_step_by_step() -> None:
    """N 4, H 8: a dz block of s columns takes s / 2 rows; the sum lives in rows [32, 40)."""
    g = Geometry(4, 8, 40, align=8, buffer_cols=8, max_cols=16, row_quantum=1)
    assert plan(g, need_dw=True, need_dh=True, stash=32) == [
        Step(32, 8, 8, 0, write_dw=False, add_dh=True),  # dh only, dz in any row below 32
        Step(0, 16, 16, 16, write_dw=True, add_dh=True),  # dz in rows [16, 24): after its own
        Step(16, 8, 8, 24, write_dw=True, add_dh=True),  # rows [24, 28)
        Step(24, 8, 8, None, write_dw=True, add_dh=True),  # [32, 36) holds the sum: the buffer
        Step(32, 8, 8, None, write_dw=True, add_dh=False),  # the sum is final: write its rows
    ]


def test_a_ragged_block_takes_its_whole_stride() -> None:
    """N = H: a column takes a row. The stashed rows [12, 20) are 8 columns, but their dz rows
    are 16 apart (the aligned stride): 16 rows, more than the 12 free ones, so the buffer."""
    g = Geometry(8, 8, 20, align=16, buffer_cols=16, max_cols=64, row_quantum=1)
    steps = plan(g, need_dw=True, need_dh=True, stash=12)
    assert steps == [
        Step(12, 8, 16, None, write_dw=False, add_dh=True),
        Step(0, 12, 16, None, write_dw=True, add_dh=True),
        Step(12, 8, 16, None, write_dw=True, add_dh=False),
    ]
    # with 16 free rows below the stash, the same block goes to dW's first rows
    wider = Geometry(8, 8, 24, align=16, buffer_cols=16, max_cols=64, row_quantum=1)
    steps = plan(wider, need_dw=True, need_dh=True, stash=16)
    assert steps[0] == Step(16, 8, 16, 0, write_dw=False, add_dh=True)


def test_stash_and_lending_need_the_weight_gradient() -> None:
    """dh only: nothing is lent and the stash is ignored; dW only: the stash is ignored."""
    g = Geometry(64, 32, 1000, align=16, buffer_cols=64, max_cols=512, row_quantum=2)
    dh_only = plan(g, need_dw=False, need_dh=True, stash=900)
    assert dh_only == [
        Step(v0, min(64, 1000 - v0), _round_up(min(64, 1000 - v0), 16), None, False, True)
        for v0 in range(0, 1000, 64)
    ]
    dw_only = plan(g, need_dw=True, need_dh=False, stash=900)
    assert dw_only == plan(g, need_dw=True, need_dh=False, stash=None)
    assert all(not s.add_dh for s in dw_only)
    assert any(s.dz_row is not None for s in dw_only)


def test_geometry_of_the_shipped_shape() -> None:
    """bf16, N 32768, H 4096: a 64 MiB buffer holds 1024 columns of 256 (lcm of the tiles),
    blocks up to 8192 wide, every dW row 16-byte aligned (8192 bytes)."""
    g = geometry(32768, 4096, 151936, 2, 256, 64 * 2**20, 8192)
    assert g == Geometry(32768, 4096, 151936, 256, 1024, 8192, 1)
    # a budget under one aligned block still gives one; never wider than the vocabulary needs
    assert geometry(32768, 4096, 151936, 2, 256, 1, 8192).buffer_cols == 256
    assert geometry(8, 3, 50, 2, 64, 2**30, 8192).buffer_cols == 64
    # H = 3 bf16: rows of 6 bytes, a 16-byte aligned start every 8 rows
    assert geometry(9, 3, 50000, 2, 256, 2**26, 8192).row_quantum == 8


def test_lent_blocks_widen_while_the_buffer_keeps_its_bound() -> None:
    """``lent_cols`` widens only the blocks in dW's unwritten rows: the buffer keeps ``max_cols``
    (and its bytes), and the first block at N = 8192 (where dW is all free) is 16384 wide."""
    g = geometry(8192, 4096, 151936, 2, 256, 256 * 2**20, 8192, 16384)
    assert (g.buffer_cols, g.max_cols) == (8192, 16384)
    steps = plan(g, need_dw=True, need_dh=True, stash=None)
    assert steps[0].cols == 16384 and steps[0].dz_row is not None
    assert all(s.cols <= 8192 for s in steps if s.dz_row is None)
    assert max(s.cols for s in steps) == 16384
