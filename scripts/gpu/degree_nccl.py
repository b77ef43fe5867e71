"""Issue 35: the same bits at any TP degree, over NCCL on 2, 4 (or 8) GPUs, in one call.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node {2,4} scripts/gpu/degree_nccl.py OUT

bf16, H=4096, V=151936, T=0.7, N=8192 and 32768, backends ``torch`` and ``triton``. Every rank
builds the same inputs, runs the one-GPU call on its own GPU with the whole weight, and then the
call at each degree ``d`` of 2, 4, 8 dividing the world (``VP_DEGREES=2,4`` to choose;
below the world size, the world's ranks form ``world / d`` groups that run side by side) on the
shards of the documented grid (``fusedhead.shards.grid_shards(V, d, caps.vocab_grid)``):

- checks: log-probs and entropy bitwise equal to the one-GPU call (the max abs diff where not),
  both gradients within relative L2 ``GRAD_TOL`` of it (the hidden gradient reduced, the weight
  gradient against the one-GPU rows of the shard);
- timings: fwd+bwd at the degree and of the one-GPU call, in ms and in GEMM units (one bf16
  ``hidden @ weight.T`` cuBLAS GEMM of the shard, and of the whole weight, timed in the same
  process), peak memory of each; and the combine alone, today's (the library's own function:
  ``fusedhead_torch.parallel.all_reduce_tile_stats`` / ``fusedhead_triton.outputs.
  _sharded_combine``) beside the previous one (before issue 33's degree-invariant change,
  b098d4b^: reimplemented here over the same per-shard statistics, see ``previous_*_combine``;
  also its cross-rank part alone), and fwd+bwd with the previous combine estimated as fwd+bwd -
  today's combine + the previous one.

Checks run first for every case, timings after, each timed loop capped at ``CAP_S`` seconds and
the whole run at ``VP_DEADLINE_S`` (cases past it are recorded as skipped). Rank 0 rewrites
``OUT/degree{d}.json`` after every case, so a timeout still leaves data. Exit 1 when a check
fails, 2 when a case was skipped for time. ``VP_REHEARSE=1``: the same on the CPU with gloo, fp32, tiny shapes and Triton under
``TRITON_INTERPRET=1`` (tests/bench/test_vocab_parallel_script.py runs it at degrees 2 and 4).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REHEARSE = os.environ.get("VP_REHEARSE") == "1"
if REHEARSE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Four grid tiles, the last ragged: degree 4 puts one on each rank, degree 2 two.
    NS, H, V, DTYPE = (8, 24), 16, 3 * 1024 + 300, torch.float32
    WARMUP, REPS, CAP_S, DEADLINE_S = 1, 1, 5.0, 600.0
else:
    NS, H, V, DTYPE = (8192, 32768), 4096, 151936, torch.bfloat16
    WARMUP, REPS, CAP_S, DEADLINE_S = 2, 10, 4.0, 420.0
DEADLINE_S = float(os.environ.get("VP_DEADLINE_S", DEADLINE_S))
T = 0.7
IGNORE = -100
#: Relative L2 bound of both gradients against the one-GPU call (the issues' gradient tolerance).
GRAD_TOL = 5e-3
BACKENDS = [b for b in os.environ.get("VP_BACKENDS", "torch,triton").split(",") if b]

import triton  # noqa: E402  (after TRITON_INTERPRET is set: jit reads it when it decorates)
import triton.language as tl  # noqa: E402

START = time.monotonic()


def device() -> torch.device:
    """This rank's device: its GPU, or the CPU when rehearsing."""
    return torch.device("cpu") if REHEARSE else torch.device("cuda", torch.cuda.current_device())


def sync() -> None:
    """Wait for the GPU (nothing on the CPU)."""
    if not REHEARSE:
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against ``b`` (in float64)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest ``|a - b|`` (inf where one is NaN and the other not)."""
    d = (a.double() - b.double()).abs()
    return float(torch.where(a.isnan() & b.isnan(), 0.0, d.nan_to_num(nan=math.inf)).max())


def inputs(n: int) -> dict[str, torch.Tensor]:
    """The same full problem on every rank (one seeded generator on the rank's device)."""
    dev = device()
    g = torch.Generator(device=dev).manual_seed(35 + n)
    y = torch.randint(0, V, (n,), device=dev, generator=g)
    y[torch.rand(n, device=dev, generator=g) < 0.1] = IGNORE
    return {
        "hidden": torch.randn(n, H, device=dev, generator=g).to(DTYPE),
        "weight": (torch.randn(V, H, device=dev, generator=g) / H**0.5).to(DTYPE),
        "labels": y,
        "g_lp": torch.randn(n, device=dev, generator=g),
        "g_ent": torch.randn(n, device=dev, generator=g),
    }


class Step:
    """One forward + backward of ``fused_head`` on fixed leaves (grads reset, never cloned)."""

    def __init__(self, backend: str, x: dict[str, torch.Tensor], w: torch.Tensor, **kw: Any):
        self.backend, self.x, self.kw = backend, x, kw
        self.h = x["hidden"].detach().clone().requires_grad_()
        self.w = w.detach().clone().requires_grad_()

    def __call__(self) -> dict[str, torch.Tensor]:
        """Outputs and both gradients of one fwd+bwd."""
        from fusedhead import fused_head

        self.h.grad = self.w.grad = None
        x = self.x
        out = fused_head(
            self.h, self.w, x["labels"], backend=self.backend, temperature=T, **self.kw
        )
        assert out.entropy is not None
        torch.autograd.backward([out.log_probs, out.entropy], [x["g_lp"], x["g_ent"]])
        assert self.h.grad is not None and self.w.grad is not None
        return {
            "log_probs": out.log_probs.detach(),
            "entropy": out.entropy.detach(),
            "grad_hidden": self.h.grad,
            "grad_weight": self.w.grad,
        }


def agreed_max(value: float) -> float:
    """The largest ``value`` over all ranks (every rank gets the same answer)."""
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed_ms(fn: Callable[[], object]) -> tuple[float, int]:
    """Median ms of ``fn`` and the run count: ``WARMUP`` runs, then ``REPS`` runs or as many as
    fit ``CAP_S`` by the slowest rank's last warm-up run (the same count on every rank, since a rank that
    runs a collective fewer times than the others hangs them)."""
    for _ in range(WARMUP - 1):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    each = agreed_max(time.perf_counter() - t0)
    reps = max(min(2, REPS), min(REPS, int(CAP_S / max(each, 1e-9))))
    dist.barrier()
    times = []
    for _ in range(reps):
        if REHEARSE:
            t1 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t1) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    dist.barrier()
    return float(statistics.median(times)), reps


def peak_gib(fn: Callable[[], object]) -> dict[str, float] | None:
    """Peak memory of one ``fn()`` on this rank's GPU: above what was allocated, and in all."""
    if REHEARSE:
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return {"extra": (peak - base) / 2**30, "total": peak / 2**30}


# --- The previous combine (b098d4b^), over the same per-shard statistics as today's ---------


@triton.jit
def _previous_combine_kernel(
    ws_ptr,
    zy_ptr,
    labels_ptr,
    out0_ptr,
    out1_ptr,
    out2_ptr,
    N,
    T,
    STAT_STRIDE,
    ignore_index,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FINAL: tl.constexpr,
):
    """b098d4b^'s ``combine_kernel`` without q and argmax: the ``T`` (m, s, w) partials of each
    row in a fixed order, a max pass then an fp32 sum pass. FINAL: log_prob, lse, entropy;
    else the row's (m, s, w), the partial a rank contributed to the all-gather."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    big_m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        mask = (tt < T)[:, None] & row_ok[None, :]
        off = tt.to(tl.int64)[:, None] * N + rows[None, :]
        m = tl.load(ws_ptr + off, mask=mask, other=float("-inf"))
        big_m = tl.maximum(big_m, tl.max(m, axis=0))
    safe_m = tl.where(big_m > float("-inf"), big_m, 0.0)
    big_s = tl.zeros((BLOCK_R,), tl.float32)
    big_w = tl.zeros((BLOCK_R,), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        mask = (tt < T)[:, None] & row_ok[None, :]
        off = tt.to(tl.int64)[:, None] * N + rows[None, :]
        m = tl.load(ws_ptr + off, mask=mask, other=float("-inf"))
        s = tl.load(ws_ptr + STAT_STRIDE + off, mask=mask, other=0.0)
        w = tl.load(ws_ptr + 2 * STAT_STRIDE + off, mask=mask, other=0.0)
        live = m > float("-inf")
        dm = tl.where(live, m - safe_m[None, :], 0.0)
        scale = tl.where(live, tl.exp2(dm * 1.4426950408889634), 0.0)
        big_s += tl.sum(s * scale, axis=0)
        big_w += tl.sum((w + dm * s) * scale, axis=0)
    if FINAL:
        big_s = tl.where(row_ok, big_s, 1.0)
        log_s = tl.log(big_s)
        lse = big_m + log_s
        zy = tl.load(zy_ptr + rows, mask=row_ok, other=0.0)
        lab = tl.load(labels_ptr + rows, mask=row_ok, other=ignore_index)
        valid = lab != ignore_index
        tl.store(out0_ptr + rows, tl.where(valid, zy - lse, 0.0), mask=row_ok)
        tl.store(out1_ptr + rows, lse, mask=row_ok)
        tl.store(out2_ptr + rows, tl.where(valid, log_s - big_w / big_s, 0.0), mask=row_ok)
    else:
        tl.store(out0_ptr + rows, big_m, mask=row_ok)
        tl.store(out1_ptr + rows, big_s, mask=row_ok)
        tl.store(out2_ptr + rows, big_w, mask=row_ok)


def _previous_kernel(ws: torch.Tensor, zy: torch.Tensor, labels: torch.Tensor, final: bool) -> list:
    """Launch ``_previous_combine_kernel`` over ``ws [3, T, N]`` (64 rows a program, as then)."""
    _, t, n = ws.shape
    outs = [torch.empty(n, dtype=torch.float32, device=ws.device) for _ in range(3)]
    _previous_combine_kernel[(math.ceil(n / 64),)](
        ws,
        zy,
        labels,
        *outs,
        n,
        t,
        t * n,
        IGNORE,
        BLOCK_R=64,
        BLOCK_T=64,
        FINAL=final,
        num_warps=4,
    )
    return outs


def previous_triton_combine(
    p: Any, labels: torch.Tensor, lo: int, rows: int, group: Any, shard_stats: list | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """triton's combine before issue 33: the shard's tiles combined to one (m, s, w) per row
    (``shard_stats`` where given: the cross-rank part alone), every rank's (m, s, w, owned label
    logit, owner) and shard slots all-gathered, and the ranks combined in rank order like tiles.
    Returns (log_probs, entropy)."""
    from fusedhead.shards import shard_slots_tensor

    m, s, w = shard_stats or _previous_kernel(p.ws, p.zy, labels, final=False)
    owned = (labels >= lo) & (labels < lo + rows)
    local = torch.stack([m, s, w, torch.where(owned, p.zy, 0.0), owned.to(torch.float32)])
    slots = shard_slots_tensor(lo, rows, V, local.device).expand(local.shape[0], -1)
    local = torch.cat([local, slots], dim=1)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    every = torch.stack(parts, dim=1)[..., : labels.shape[0]]  # [5, R, N]
    label_logit = torch.where(every[4].sum(0) == 1, every[3].sum(0), float("nan"))
    lp, _, ent = _previous_kernel(every[:3].contiguous(), label_logit, labels, final=True)
    return lp, ent


def torch_tile_stats(
    h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, lo: int, grid: int
) -> tuple[Any, torch.Tensor]:
    """The torch backend's per-shard statistics: (m, s, t) of each ``grid``-column tile of the
    shard, from fp32 logits as its forward makes them, and the owned label logit (0 elsewhere)."""
    from fusedhead_torch.rowstats import TileStats
    from fusedhead_torch.tile_math import logits_mm

    n = h.shape[0]
    ms, ss, ts = [], [], []
    z_label = torch.zeros(n, dtype=torch.float32, device=h.device)
    for c0 in range(0, w.shape[0], grid):
        c1 = min(c0 + grid, w.shape[0])
        z = logits_mm(h, w[c0:c1].T, True).float() * (1.0 / T)
        m = z.amax(dim=1)
        d = z - m[:, None]
        e = d.exp()
        ms.append(m)
        ss.append(e.sum(dim=1))
        ts.append((e * d).sum(dim=1))
        mine = (labels >= lo + c0) & (labels < lo + c1)
        col = (labels - lo - c0).clamp(0, c1 - c0 - 1)
        z_label = torch.where(mine, z.gather(1, col[:, None]).squeeze(1), z_label)
    return TileStats(torch.stack(ms), torch.stack(ss), torch.stack(ts)), z_label


def _finish(
    m: torch.Tensor, s: torch.Tensor, t: torch.Tensor, zl: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log-probs and entropy from full-vocabulary (m, s, t) as the torch backend finishes them."""
    valid = labels != IGNORE
    log_s = torch.log(s)
    lp = torch.where(valid, (zl - m).sub_(log_s), 0.0)
    return lp, torch.where(valid, log_s - t / s, 0.0)


def previous_torch_combine(
    stats: Any,
    z_label: torch.Tensor,
    labels: torch.Tensor,
    group: Any,
    shard: tuple[int, int, int],
    merged: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's combine before issue 33: the tiles merged in order (``RowStats.merged``, as its
    forward walk did block by block; ``merged`` where given: the cross-rank part alone), then
    ``all_reduce_row_stats`` (a MAX of the row max, one fp32 SUM of the rebased s, t, label logit
    and shard slots). Returns (log_probs, entropy)."""
    from fusedhead_torch.parallel import all_reduce_row_stats
    from fusedhead_torch.rowstats import RowStats

    run = merged
    if run is None:
        run = RowStats(stats.m[0], stats.s[0], stats.t[0])
        for i in range(1, stats.m.shape[0]):
            run = run.merged(RowStats(stats.m[i], stats.s[i], stats.t[i]))
    rs, zl = all_reduce_row_stats(run, z_label, group, shard)
    return _finish(rs.m, rs.s, rs.t, zl, labels)


def today_torch_combine(
    stats: Any, z_label: torch.Tensor, labels: torch.Tensor, group: Any, shard: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's combine now: ``all_reduce_tile_stats`` (MAX, one int64 SUM), then the finish."""
    from fusedhead_torch.parallel import all_reduce_tile_stats

    rs, zl, _ = all_reduce_tile_stats(stats, z_label, group, shard)
    return _finish(rs.m, rs.s, rs.t, zl, labels)


def combines(
    backend: str, x: dict[str, torch.Tensor], lo: int, rows: int, grid: int, group: Any
) -> dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """Today's combine of this rank's shard, the previous one, and the previous one's cross-rank
    part alone (the shard's own pass done beforehand; in the old torch forward that pass was the
    walk's running merge), as calls over its statistics (computed here, outside any timing)."""
    h, labels = x["hidden"], x["labels"]
    w = x["weight"][lo : lo + rows]
    if backend == "torch":
        from fusedhead_torch.rowstats import RowStats

        stats, zl = torch_tile_stats(h, w, labels, lo, grid)
        shard = (lo, rows, V)
        run = None
        for i in range(stats.m.shape[0]):
            tile = RowStats(stats.m[i], stats.s[i], stats.t[i])
            run = tile if run is None else run.merged(tile)
        return {
            "today": lambda: today_torch_combine(stats, zl, labels, group, shard),
            "previous": lambda: previous_torch_combine(stats, zl, labels, group, shard),
            "previous_cross_rank": lambda: previous_torch_combine(
                stats, zl, labels, group, shard, merged=run
            ),
        }
    from fusedhead_triton import TritonBackend
    from fusedhead_triton.launch import HeadScalars, forward_partials
    from fusedhead_triton.outputs import _sharded_combine

    cfg = TritonBackend()._settings(DTYPE)[0].forward
    sc = HeadScalars(lo, IGNORE, 1.0 / T, None)
    p = forward_partials(h, w, labels, None, sc, cfg)
    msw = _previous_kernel(p.ws, p.zy, labels, final=False)

    def today() -> tuple[torch.Tensor, torch.Tensor]:
        out = _sharded_combine(p, None, None, labels, sc, rows, cfg, True, False, False, group, V)
        return out[0], out[2]

    return {
        "today": today,
        "previous": lambda: previous_triton_combine(p, labels, lo, rows, group),
        "previous_cross_rank": lambda: previous_triton_combine(p, labels, lo, rows, group, msw),
    }


# --- The run --------------------------------------------------------------------------------


class Degree:
    """A degree's groups, this rank's group and shard on the grid, and its JSON."""

    def __init__(self, d: int, grid: int, out: Path, meta: dict[str, Any]):
        from fusedhead.shards import grid_shards

        rank, world = dist.get_rank(), dist.get_world_size()
        groups = [list(range(i, i + d)) for i in range(0, world, d)]
        handles = [dist.new_group(g) if d < world else dist.group.WORLD for g in groups]
        self.d, self.members = d, groups[rank // d]
        self.group = handles[rank // d]
        self.shards = grid_shards(V, d, grid)
        self.lo, self.rows = self.shards[rank % d]
        self.path = out / f"degree{d}.json"
        self.doc: dict[str, Any] = {
            "meta": {
                **meta,
                "degree": d,
                "groups": groups,
                "grid": grid,
                "shards": [list(s) for s in self.shards],
            },
            "checks": [],
            "timings": [],
            "skipped": [],
            "done": False,
        }

    def add(self, kind: str, rec: dict[str, Any]) -> None:
        """Gather every rank's ``rec`` into ``doc[kind]``; rank 0 rewrites the JSON at once."""
        recs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(recs, rec)
        self.doc[kind].extend(recs)
        self.write()

    def write(self) -> None:
        """Rank 0 replaces ``OUT/degree{d}.json`` with the records so far."""
        if dist.get_rank() == 0:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.doc, indent=1))
            os.replace(tmp, self.path)


def past_deadline() -> bool:
    """Whether rank 0 is past ``DEADLINE_S`` (the same answer on every rank)."""
    late = torch.tensor([int(time.monotonic() - START > DEADLINE_S)], device=device())
    dist.broadcast(late, 0)
    return bool(late.item())


def check(backend: str, n: int, degrees: list[Degree]) -> list[bool]:
    """The one-GPU call, then each degree's call on its grid shard, compared; one record each.
    Also keeps the one-GPU log-probs and entropy for the combines' comparison."""
    x = inputs(n)
    ref = Step(backend, x, x["weight"])()
    REF[(backend, n)] = (ref["log_probs"], ref["entropy"])
    oks = []
    for dg in degrees:
        rec: dict[str, Any] = {
            "backend": backend,
            "N": n,
            "rank": dist.get_rank(),
            "group": dg.members,
            "shard": [dg.lo, dg.rows],
        }
        try:
            w = x["weight"][dg.lo : dg.lo + dg.rows]
            kw = {"process_group": dg.group, "vocab_start": dg.lo, "vocab_size": V}
            got = Step(backend, x, w, **kw)()
            fwd = ("log_probs", "entropy")
            rec["bitwise"] = {k: same_bits(got[k], ref[k]) for k in fwd}
            rec["max_abs_diff"] = {k: max_abs(got[k], ref[k]) for k in fwd}
            grads = {
                "grad_hidden": (got["grad_hidden"], ref["grad_hidden"]),
                "grad_weight": (got["grad_weight"], ref["grad_weight"][dg.lo : dg.lo + dg.rows]),
            }
            rec["grad_rel_l2"] = {k: rel(a, b) for k, (a, b) in grads.items()}
            rec["grad_bitwise"] = {k: same_bits(a, b) for k, (a, b) in grads.items()}
            rec["grad_tol"] = GRAD_TOL
            rec["pass"] = all(rec["bitwise"].values()) and all(
                e <= GRAD_TOL for e in rec["grad_rel_l2"].values()
            )
            del got
        except Exception as exc:  # recorded; the other degrees still run
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["pass"] = False
        rec["at_s"] = time.monotonic() - START
        dg.add("checks", rec)
        oks.append(bool(rec["pass"]))
        if dist.get_rank() == 0:
            print(json.dumps({"degree": dg.d, **rec}), flush=True)
    del ref, x
    empty_cache()
    return oks


def timings(backend: str, n: int, degrees: list[Degree]) -> None:
    """fwd+bwd (ms, GEMM units, peak memory) of the one-GPU call and at each degree, and today's
    and the previous combine over this rank's shard statistics; one record per degree."""
    x = inputs(n)
    h, w = x["hidden"], x["weight"]
    one = Step(backend, x, w)
    single_ms, single_reps = timed_ms(one)
    full_unit, _ = timed_ms(lambda: torch.mm(h, w.T))
    single = {
        "fwd_bwd_ms": single_ms,
        "reps": single_reps,
        "gemm_unit_ms": full_unit,
        "fwd_bwd_units": single_ms / full_unit,
        "peak_gib": peak_gib(one),
    }
    del one
    empty_cache()
    for dg in degrees:
        if past_deadline():
            dg.add(
                "skipped",
                {
                    "backend": backend,
                    "N": n,
                    "rank": dist.get_rank(),
                    "what": "timings",
                    "why": "deadline",
                },
            )
            continue
        rec: dict[str, Any] = {
            "backend": backend,
            "N": n,
            "rank": dist.get_rank(),
            "group": dg.members,
            "shard": [dg.lo, dg.rows],
            "concurrent_groups": dist.get_world_size() // dg.d,
            "single_gpu": single,
        }
        try:
            shard = w[dg.lo : dg.lo + dg.rows]
            kw = {"process_group": dg.group, "vocab_start": dg.lo, "vocab_size": V}
            par = Step(backend, x, shard, **kw)
            ms, reps = timed_ms(par)
            unit, _ = timed_ms(lambda s=shard: torch.mm(h, s.T))
            rec.update(
                fwd_bwd_ms=ms,
                reps=reps,
                gemm_unit_ms=unit,
                fwd_bwd_units=ms / unit,
                peak_gib=peak_gib(par),
                speedup_vs_single_gpu=single_ms / ms,
            )
            del par
            calls = combines(backend, x, dg.lo, dg.rows, GRID[backend], dg.group)
            lp_ref, ent_ref = REF[(backend, n)]
            comb: dict[str, Any] = {}
            for name, fn in calls.items():
                lp, ent = fn()
                c_ms, c_reps = timed_ms(fn)
                comb[name] = {
                    "ms": c_ms,
                    "reps": c_reps,
                    "peak_gib": peak_gib(fn),
                    "max_abs_diff_vs_single_gpu": {
                        "log_probs": max_abs(lp, lp_ref),
                        "entropy": max_abs(ent, ent_ref),
                    },
                }
            comb["today_fraction_of_fwd_bwd"] = comb["today"]["ms"] / ms
            comb["previous_fraction_of_fwd_bwd"] = comb["previous"]["ms"] / ms
            rec["combine"] = comb
            est = ms - comb["today"]["ms"] + comb["previous"]["ms"]
            rec["previous_combine_fwd_bwd_ms_est"] = est
            rec["previous_combine_fwd_bwd_units_est"] = est / unit
            del calls
        except Exception as exc:  # recorded; the other degrees still run
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["at_s"] = time.monotonic() - START
        dg.add("timings", rec)
        if dist.get_rank() == 0:
            print(json.dumps({"degree": dg.d, **rec}), flush=True)
        empty_cache()


def empty_cache() -> None:
    """Give cached GPU memory back between cases (peak figures start from the same place)."""
    if not REHEARSE:
        torch.cuda.empty_cache()


REF: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
GRID: dict[str, int] = {}


def meta() -> dict[str, Any]:
    """What ran where: versions, device, shapes, timing rules."""
    commit = os.environ.get("FUSEDHEAD_GIT_COMMIT")
    if not commit:
        try:
            commit = (
                subprocess.run(
                    ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
                ).stdout.strip()
                or None
            )
        except OSError:
            commit = None
    return {
        "issue": 35,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "device": "cpu (rehearsal)" if REHEARSE else torch.cuda.get_device_name(0),
        "world": dist.get_world_size(),
        "dist_backend": dist.get_backend(),
        "nccl": None if REHEARSE else str(torch.cuda.nccl.version()),
        "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"N": list(NS), "H": H, "V": V, "dtype": str(DTYPE), "temperature": T},
        "grad_tol": GRAD_TOL,
        "timing": f"median of up to {REPS} runs after {WARMUP} warm-up runs, capped at {CAP_S} s "
        "by the slowest rank's last warm-up run, the same count on every rank",
        "previous_combine": "b098d4b^ reimplemented in scripts/gpu/degree_nccl.py over the same "
        "per-shard statistics (torch: RowStats.merged over the tiles + all_reduce_row_stats; "
        "triton: the old combine kernel per shard, all-gather, the kernel over the ranks); "
        "previous fwd+bwd = fwd+bwd - today's combine + previous combine (estimated)",
    }


def main() -> int:
    """Checks for every case, then timings, within the deadline; exit 1 when a check fails."""
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "degree_nccl_out")
    timeout = timedelta(seconds=180)
    if REHEARSE:
        dist.init_process_group("gloo", timeout=timeout)
    else:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    from fusedhead import FusedHead

    asked = [int(d) for d in os.environ.get("VP_DEGREES", "").split(",") if d]
    wanted = [d for d in asked or (2, 4, 8) if 1 < d <= world and world % d == 0]
    backends = []
    for name in BACKENDS:
        caps = FusedHead({"backend": name}).capabilities(device())
        if caps.degree_invariant and caps.vocab_grid:
            GRID[name] = caps.vocab_grid
            backends.append(name)
        elif rank == 0:
            print(f"{name}: does not declare degree_invariant; skipped", flush=True)
    grids = sorted(set(GRID.values()))
    if len(grids) != 1 or not wanted:  # one layout per degree serves every backend
        raise SystemExit(f"need one vocab grid and a degree: grids {GRID}, degrees {wanted}")
    info = meta()
    degrees = [Degree(d, grids[0], out, info) for d in wanted]
    oks: list[bool] = []
    skipped = 0
    cases = [(b, n) for n in NS for b in backends]
    for what in ("checks", "timings"):
        for b, n in cases:
            if past_deadline():
                skipped += what == "checks"
                for dg in degrees:
                    dg.add(
                        "skipped",
                        {
                            "backend": b,
                            "N": n,
                            "rank": rank,
                            "what": what,
                            "why": f"past the deadline of {DEADLINE_S:.0f} s",
                        },
                    )
                continue
            if what == "checks":
                oks.extend(check(b, n, degrees))
            else:
                timings(b, n, degrees)
    for dg in degrees:
        dg.doc["done"] = True
        dg.doc["meta"]["elapsed_s"] = time.monotonic() - START
        dg.write()
    ok = agreed_max(0.0 if all(oks) else 1.0) == 0.0
    if rank == 0:
        verdict = "every check passed" if ok else "a check did NOT pass"
        print(
            f"degrees {wanted}: {len(oks)} checks per rank, {verdict}"
            f"{f', {skipped} cases skipped (deadline)' if skipped else ''}; "
            f"{time.monotonic() - START:.0f} s; JSON in {out}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok and not skipped else 1 if not ok else 2


if __name__ == "__main__":
    code = main()
    # The results are written and the process group destroyed: leave without the interpreter's
    # teardown, where gloo's worker threads may still be joinable and abort a finished rank
    # ("terminate called without an active exception", no Python frame; about one 2-rank CPU
    # rehearsal in 40; pytorch/pytorch#179291 describes the teardown race).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
