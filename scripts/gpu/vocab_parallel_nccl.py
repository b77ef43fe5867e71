"""Issue 9: vocab-parallel on two GPUs over NCCL, against the single-GPU result of each backend.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 scripts/gpu/vocab_parallel_nccl.py OUT.json

For each backend (torch, triton, liger native), N=8192, H=4096, V=151936, bf16, T=0.7: equal and
uneven shards (where the backend declares ``uneven_shards``), ``reduce_hidden_grad`` True and
False (False: the sum of the ranks' partial hidden gradients must equal the full one). Each rank
compares outputs and both gradients with the same backend run on its own GPU with the whole
weight, times forward+backward in GEMM units of its local shard, and measures peak extra memory.
A backend that does not declare vocab_parallel is recorded with its reason. Rank 0 writes JSON.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist

N, H, V, T = 8192, 4096, 151936, 0.7
#: The single-GPU acceptance tolerances of the backend issues (relative L2 against a reference).
TOL = {"log_probs": 3e-4, "entropy": 1e-4, "grad_hidden": 5e-3, "grad_weight": 5e-3}
BACKENDS = {"torch": {}, "triton": {}, "liger": {"implementation": "native"}}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def inputs(
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)  # the same full inputs on every rank
    h = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).bfloat16()
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    y[torch.rand(N, device="cuda", generator=g) < 0.1] = -100
    g_lp = torch.randn(N, device="cuda", generator=g)
    g_ent = torch.randn(N, device="cuda", generator=g)
    return h, w, y, g_lp, g_ent


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


def timed(fn: Any) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=200, rep=2000, return_mode="median"))


def run_case(name: str, options: dict[str, Any], bounds: list[int], reduce: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    h, w, y, g_lp, g_ent = inputs(rank)
    lo, hi = bounds[rank], bounds[rank + 1]
    single = step(name, options, h, w, y, g_lp, g_ent)
    shard = w[lo:hi].contiguous()
    kw = {
        "process_group": dist.group.WORLD,
        "vocab_start": lo,
        "vocab_size": V,
        "reduce_hidden_grad": reduce,
    }
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    par = step(name, options, h, shard, y, g_lp, g_ent, **kw)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    dh = par["grad_hidden"].float()
    if not reduce:  # partial gradients: their sum is the full one
        dist.all_reduce(dh)
    errs = {
        "log_probs": rel(par["log_probs"], single["log_probs"]),
        "entropy": rel(par["entropy"], single["entropy"]),
        "grad_hidden": rel(dh, single["grad_hidden"].float()),
        "grad_weight": rel(par["grad_weight"], single["grad_weight"][lo:hi]),
    }
    unit = timed(lambda: torch.mm(h, shard.T))
    ms = timed(lambda: step(name, options, h, shard, y, g_lp, g_ent, **kw))
    return {
        "backend": name,
        "options": options,
        "rank": rank,
        "world": world,
        "shard": [lo, hi],
        "reduce_hidden_grad": reduce,
        "errors_vs_single_gpu": errs,
        "pass": all(errs[k] <= TOL[k] for k in TOL),
        "fwd_bwd_ms": ms,
        "local_gemm_unit_ms": unit,
        "fwd_bwd_units_local": ms / unit,
        "peak_extra_gib": peak,
    }


def main() -> int:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    from fusedhead import FusedHead

    records: list[dict[str, Any]] = []
    equal = [r * V // world for r in range(world + 1)]
    uneven = [
        0,
        *[min(V, (r + 1) * V // world + 9024 * (1 if r == 0 else -1)) for r in range(world - 1)],
        V,
    ]
    for name, options in BACKENDS.items():
        caps = FusedHead({"backend": name, "options": options}).capabilities("cuda")
        if not caps.vocab_parallel:
            records.append(
                {
                    "backend": name,
                    "options": options,
                    "rank": rank,
                    "declared": False,
                    "reason": "does not declare vocab_parallel",
                }
            )
            continue
        layouts = {"equal": equal, **({"uneven": uneven} if caps.uneven_shards else {})}
        for layout, bounds in layouts.items():
            for reduce in (True, False):
                try:
                    rec = run_case(name, options, bounds, reduce)
                except Exception as exc:  # record and go on: one backend's failure is its own
                    rec = {"backend": name, "rank": rank, "error": f"{type(exc).__name__}: {exc}"}
                rec["layout"] = layout
                records.append(rec)
                print(json.dumps(rec), flush=True)
                torch.cuda.empty_cache()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        meta = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "shape": {"N": N, "H": H, "V": V, "dtype": "bf16", "temperature": T},
            "tolerances": TOL,
        }
        with open(sys.argv[1] if len(sys.argv) > 1 else "vocab_parallel_nccl.json", "w") as f:
            json.dump({"meta": meta, "records": [r for rs in gathered for r in rs]}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
