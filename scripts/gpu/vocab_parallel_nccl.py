"""Issue 9: vocab-parallel on two GPUs over NCCL, against the single-GPU result of each backend.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 scripts/gpu/vocab_parallel_nccl.py OUT.json

For each backend (torch, triton, liger native and liger fallback), N=8192, H=4096, V=151936,
bf16, T=0.7: equal and uneven shards (where the backend declares ``uneven_shards``),
``reduce_hidden_grad`` True and False (False: the sum of the ranks' partial hidden gradients must
equal the full one). Each rank compares outputs and both gradients with the same backend run on
its own GPU with the whole weight, times forward+backward in GEMM units of its local shard, and
measures peak extra memory. A backend that does not declare vocab_parallel is recorded with its
reason. Rank 0 writes JSON.

``VP_REHEARSE=1`` runs the same plumbing on the CPU with gloo, fp32 and a tiny shape (the Triton
kernels under ``TRITON_INTERPRET=1``): tests/bench/test_vocab_parallel_script.py does.

Issue 35's run (bits at degree 2 and 4 on the grid's shards, the combine against the previous
one) is its successor, scripts/gpu/degree_nccl.py (scripts/gpu/issue35.sh runs it).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist

REHEARSE = os.environ.get("VP_REHEARSE") == "1"
if REHEARSE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    N, H, V, T, DTYPE = 24, 32, 200, 0.7, torch.float32
    UNEVEN_SHIFT, WARMUP, REPS = 17, 1, 2
else:
    N, H, V, T, DTYPE = 8192, 4096, 151936, 0.7, torch.bfloat16
    UNEVEN_SHIFT, WARMUP, REPS = 9024, 3, 15
#: Single-GPU acceptance tolerances (relative L2) of the backends' issues: torch (3), triton (5).
ISSUE_TOL = {
    "torch": {"log_probs": 3e-4, "entropy": 1e-4, "grad_hidden": 5e-3, "grad_weight": 5e-3},
    "triton": {"log_probs": 1e-5, "entropy": 1e-5, "grad_hidden": 5e-3, "grad_weight": 5e-3},
}
GRAD_TOL = 5e-3
BACKENDS: list[tuple[str, dict[str, Any]]] = [
    ("torch", {}),
    ("triton", {}),
    ("liger", {"implementation": "native"}),
    ("liger", {"implementation": "fallback"}),
]
#: ``VP_BACKENDS=triton,torch`` keeps only those backends (all of them when unset).
_ONLY = {b for b in os.environ.get("VP_BACKENDS", "").split(",") if b}
BACKENDS = [(name, opts) for name, opts in BACKENDS if not _ONLY or name in _ONLY]


def device() -> torch.device:
    return torch.device("cpu") if REHEARSE else torch.device("cuda", torch.cuda.current_device())


def sync() -> None:
    if not REHEARSE:
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same full inputs on every rank (one seeded generator on each)."""
    dev = device()
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(N, H, device=dev, generator=g).to(DTYPE)
    w = (torch.randn(V, H, device=dev, generator=g) / H**0.5).to(DTYPE)
    y = torch.randint(0, V, (N,), device=dev, generator=g)
    y[torch.rand(N, device=dev, generator=g) < 0.1] = -100
    g_lp = torch.randn(N, device=dev, generator=g)
    g_ent = torch.randn(N, device=dev, generator=g)
    return h, w, y, g_lp, g_ent


def zmax(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> float:
    """Largest |logit| / T over the scored rows, by row chunks (never the whole [N, V])."""
    rows = h[y != -100]
    return max(
        (float((rows[i : i + 1024].float() @ w.float().T).abs().max()) / T
         for i in range(0, rows.shape[0], 1024)),
        default=0.0,
    )  # fmt: skip


def tolerances(
    name: str, caps: Any, single: dict[str, torch.Tensor], z: float
) -> tuple[dict[str, float], str]:
    """The backend's single-GPU tolerances, and where they come from.

    torch and triton: their issues' figures. Any other backend: the conformance kit's relative
    bound for its declared precisions (forward outputs) and the issues' gradient tolerance.
    """
    if name in ISSUE_TOL:
        return ISSUE_TOL[name], f"issue tolerances of the {name} backend"
    from fusedhead.testing.tolerances import Tolerances

    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[DTYPE]
    tol = Tolerances.for_case(
        dtype=dtype,
        logits_precision=caps.logits_precision,
        entropy_precision=caps.entropy_precision,
        h=H,
        v=V,
        zmax=z,
    )
    fwd = {
        "log_probs": tol.log_probs.limits(single["log_probs"])[0],
        "entropy": tol.entropy.limits(single["entropy"])[0],
    }
    why = (
        f"conformance-kit bounds for declared logits {caps.logits_precision} / entropy "
        f"{caps.entropy_precision} precision (zmax {z:.2f}); gradients {GRAD_TOL:g}"
    )
    return {**fwd, "grad_hidden": GRAD_TOL, "grad_weight": GRAD_TOL}, why


def step(
    name: str,
    options: dict[str, Any],
    h: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor,
    **kw: Any,
) -> dict[str, torch.Tensor]:
    """One forward + backward with fresh leaves; outputs and both gradients."""
    from fusedhead import fused_head

    hh = h.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()
    out = fused_head(hh, ww, y, backend=name, options=options, temperature=T, **kw)
    assert out.entropy is not None
    torch.autograd.backward([out.log_probs, out.entropy], [g_lp, g_ent])
    assert hh.grad is not None and ww.grad is not None
    return {
        "log_probs": out.log_probs.detach(),
        "entropy": out.entropy.detach(),
        "grad_hidden": hh.grad,
        "grad_weight": ww.grad,
    }


def timed_ms(fn: Callable[[], object]) -> float:
    """Median ms over a fixed number of runs, the same on every rank.

    Not ``do_bench``: it sizes its repetitions from each rank's own estimate, and ranks that run
    a collective a different number of times deadlock.
    """
    for _ in range(WARMUP):
        fn()
    sync()
    dist.barrier()
    times = []
    for _ in range(REPS):
        if REHEARSE:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    dist.barrier()
    return float(statistics.median(times))


def peak_extra_gib(fn: Callable[[], object]) -> float | None:
    if REHEARSE:
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def run_case(
    name: str,
    options: dict[str, Any],
    caps: Any,
    bounds: list[int],
    reduce: bool,
    timing: bool,
) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    h, w, y, g_lp, g_ent = inputs()
    lo, hi = bounds[rank], bounds[rank + 1]
    single = step(name, options, h, w, y, g_lp, g_ent)
    shard = w[lo:hi].contiguous()
    kw = {
        "process_group": dist.group.WORLD,
        "vocab_start": lo,
        "vocab_size": V,
        "reduce_hidden_grad": reduce,
    }
    par = step(name, options, h, shard, y, g_lp, g_ent, **kw)
    dh = par["grad_hidden"].float()
    if not reduce:  # partial gradients: their sum is the full one
        dist.all_reduce(dh)
    errs = {
        "log_probs": rel(par["log_probs"], single["log_probs"]),
        "entropy": rel(par["entropy"], single["entropy"]),
        "grad_hidden": rel(dh, single["grad_hidden"].float()),
        "grad_weight": rel(par["grad_weight"], single["grad_weight"][lo:hi]),
    }
    tol, tol_source = tolerances(name, caps, single, zmax(h, w, y))
    del single
    rec: dict[str, Any] = {
        "backend": name,
        "options": options,
        "rank": rank,
        "world": world,
        "shard": [lo, hi],
        "reduce_hidden_grad": reduce,
        "errors_vs_single_gpu": errs,
        "tolerances": tol,
        "tolerance_source": tol_source,
        "pass": all(errs[k] <= tol[k] for k in tol),
    }
    if timing:
        hd, sd = h.detach(), shard.detach()
        unit = timed_ms(lambda: torch.mm(hd, sd.T))
        ms = timed_ms(lambda: step(name, options, h, shard, y, g_lp, g_ent, **kw))
        single_ms = timed_ms(lambda: step(name, options, h, w, y, g_lp, g_ent))
        full_unit = timed_ms(lambda: torch.mm(hd, w.T))
        rec.update(
            fwd_bwd_ms=ms,
            local_gemm_unit_ms=unit,
            fwd_bwd_units_local=ms / unit,
            single_gpu_fwd_bwd_ms=single_ms,
            single_gpu_units=single_ms / full_unit,
            speedup_vs_single_gpu=single_ms / ms,
            peak_extra_gib=peak_extra_gib(
                lambda: step(name, options, h, shard, y, g_lp, g_ent, **kw)
            ),
        )
    return rec


def shard_layouts(world: int) -> dict[str, list[int]]:
    """Equal shards, and shards shifted by ``UNEVEN_SHIFT`` rows (the first rank larger)."""
    equal = [r * V // world for r in range(world + 1)]
    uneven = list(equal)
    for r in range(1, world):
        uneven[r] = min(V, equal[r] + (UNEVEN_SHIFT if r == 1 else 0))
    return {"equal": equal, "uneven": uneven}


def main() -> int:
    if REHEARSE:
        dist.init_process_group("gloo")
    else:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group("nccl")
        torch.cuda.set_device(dist.get_rank())
    rank, world = dist.get_rank(), dist.get_world_size()
    from fusedhead import FusedHead

    records: list[dict[str, Any]] = []
    layouts = shard_layouts(world)
    for name, options in BACKENDS:
        base = {"backend": name, "options": options, "rank": rank}
        try:
            caps = FusedHead({"backend": name, "options": options}).capabilities(device())
        except Exception as exc:  # not installed or not loadable: recorded, not fatal
            records.append({**base, "error": f"{type(exc).__name__}: {exc}"})
            continue
        if not caps.vocab_parallel:
            records.append({**base, "declared": False, "reason": "does not declare vocab_parallel"})
            continue
        for layout, bounds in layouts.items():
            if layout == "uneven" and not caps.uneven_shards:
                records.append({**base, "layout": layout, "declared": False,
                                "reason": "does not declare uneven_shards"})  # fmt: skip
                continue
            for reduce in (True, False):
                try:
                    rec = run_case(name, options, caps, bounds, reduce, timing=layout == "equal")
                except Exception as exc:  # one backend's failure is its own
                    rec = {**base, "error": f"{type(exc).__name__}: {exc}"}
                rec["layout"] = layout
                records.append(rec)
                print(json.dumps(rec), flush=True)
                if not REHEARSE:
                    torch.cuda.empty_cache()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        import triton

        meta = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": "cpu (rehearsal)" if REHEARSE else torch.cuda.get_device_name(0),
            "world": world,
            "backend": dist.get_backend(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "shape": {"N": N, "H": H, "V": V, "dtype": str(DTYPE), "temperature": T},
            "timing": f"median of {REPS} runs after {WARMUP} warm-up runs, same count on every rank",
        }
        path = sys.argv[1] if len(sys.argv) > 1 else "vocab_parallel_nccl.json"
        with open(path, "w") as f:
            json.dump({"meta": meta, "records": [r for rs in gathered for r in rs]}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # The results are written and the process group destroyed: leave without the interpreter's
    # teardown, where gloo's worker threads may still be joinable and abort a finished rank
    # ("terminate called without an active exception", no Python frame; about one 2-rank CPU
    # rehearsal in 40; pytorch/pytorch#179291 describes the teardown race).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
