"""Issue 31 probe: where a *hot* fused policy step's time goes, and what other chunkings would
give (one CUDA GPU, bf16, H = 4096, V = 151936, T = 0.7): a checked call hands the backend the
scored rows alone, ``--every-row`` runs the same with ``check_labels=False`` (every row).

    python scripts/gpu/policy_probe.py OUT_DIR [--n 8192 ...]

1. The GEMM unit cold (after two warm-ups) and hot (after seconds of back-to-back GEMMs).
2. Each case, hot: median fwd+bwd ms over CUDA events, and the same step under torch.profiler:
   the sum of its kernels' device time (what the GPU computed) beside the step's wall time (the
   gap is the GPU idle), the top kernels.
3. cuBLAS bf16 x bf16 -> fp32 logits (``out_dtype``): time, and whether a row's values depend on
   how many rows share the GEMM (batch invariance).
Writes OUT_DIR/policy_probe.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from policy_loss_bench import LOSS, build, make_inputs, timed


def heat(a: torch.Tensor, b: torch.Tensor, seconds: float) -> None:
    """Back-to-back GEMMs until the GPU's clock settles under its power limit."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ b.T
        torch.cuda.synchronize()


def every_row(backend: str, x: dict[str, Any]) -> Any:
    """The fused loss with ``check_labels=False``: nothing read, the backend sees every row."""
    import fusedhead

    head = fusedhead.FusedHead({"backend": backend, "check_labels": False})
    terms = {k: x[k] for k in ("old_log_probs", "advantages", "ref_log_probs")}

    def fn(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return head.policy_loss(h, w, x["labels"], **terms, **LOSS).loss

    return fn


def profile_step(fn: Any, h: torch.Tensor, w: torch.Tensor) -> dict[str, Any]:
    for _ in range(3):
        fn(h, w).backward()
    torch.cuda.synchronize()
    reps = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(h, w).backward()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / reps * 1e3
    rows = [
        (e.key, e.device_time_total / reps / 1e3, e.count // reps)
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    rows.sort(key=lambda r: -r[1])
    return {
        "kernels_ms": sum(r[1] for r in rows),
        "wall_in_profiler_ms": wall,
        "launches": sum(r[2] for r in rows),
        "top": [{"kernel": k[:90], "ms": round(ms, 3), "count": c} for k, ms, c in rows[:14]],
    }


def cublas_fp32(x: dict[str, Any]) -> dict[str, Any]:
    hid, wt = x["hidden"], x["weight"]
    out: dict[str, Any] = {}
    try:
        full = torch.mm(hid, wt.T, out_dtype=torch.float32)
    except (TypeError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    out["ms_fp32_out"] = statistics.median(
        timed(lambda: torch.mm(hid, wt.T, out_dtype=torch.float32), 5, hid.device)
    )
    out["ms_bf16_out"] = statistics.median(timed(lambda: hid @ wt.T, 5, hid.device))
    same = {}
    for m in (4096, 3456, 1767, 1280, 257, 64, 16, 1):
        part = torch.mm(hid[:m], wt.T, out_dtype=torch.float32)
        same[str(m)] = bool(torch.equal(part[: min(m, 64)], full[: min(m, 64)]))
    shifted = torch.mm(hid[5:1029], wt.T, out_dtype=torch.float32)
    same["rows 5..1028"] = bool(torch.equal(shifted, full[5:1029]))
    out["rows_equal_to_the_full_batch"] = same
    del full
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--n", type=int, nargs="+", default=[8192])
    p.add_argument("--every-row", nargs="*", default=[], help="backends, also run unchecked")
    p.add_argument("--impl", nargs="+", default=[
        "fused:triton", "fused:triton:policy_chunk_rows=2736", "fused:triton:policy_chunk_rows=4096",
        "fused:triton:policy_chunk_rows=8192", "unfused:triton",
    ])  # fmt: skip
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    for n in a.n:
        x = make_inputs(n, 4096, 151936, dev, torch.bfloat16)
        hid, wt = x["hidden"], x["weight"]
        cold = statistics.median(timed(lambda a=hid, b=wt: a @ b.T, 5, dev))
        heat(hid, wt, 8.0)
        hot = statistics.median(timed(lambda a=hid, b=wt: a @ b.T, 7, dev))
        rec: dict[str, Any] = {"gemm_unit_cold_ms": cold, "gemm_unit_hot_ms": hot, "cases": []}
        print(json.dumps({"n": n, "unit_cold": cold, "unit_hot": hot}), flush=True)
        for spec in [*a.impl, *(f"every-row:{b}" for b in a.every_row)]:
            inp = x
            case: dict[str, Any] = {"impl": spec, "rows": int(inp["hidden"].shape[0])}
            try:
                kind, _, name = spec.partition(":")
                fn = every_row(name, inp) if kind == "every-row" else build(spec, inp)
                h = inp["hidden"].detach().clone().requires_grad_()
                w = inp["weight"].detach().clone().requires_grad_()
                h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)

                def step(fn: Any = fn, h: torch.Tensor = h, w: torch.Tensor = w) -> None:
                    fn(h, w).backward()

                unit = statistics.median(timed(lambda a=hid, b=wt: a @ b.T, 5, dev))
                ms = statistics.median(timed(step, 7, dev))
                case.update(unit_ms=unit, fwd_bwd_ms=ms, units=ms / unit)
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                step()
                torch.cuda.synchronize()
                case["peak_extra_gib"] = (torch.cuda.max_memory_allocated(dev) - before) / 2**30
                case["profile"] = profile_step(fn, h, w)
                del h, w
            except Exception as exc:  # recorded, the probe goes on
                case["error"] = f"{type(exc).__name__}: {exc}"[:400]
            rec["cases"].append(case)
            short = {k: v for k, v in case.items() if k != "profile"}
            if "profile" in case:
                pr = case["profile"]
                short.update(kernels_ms=pr["kernels_ms"], wall_prof=pr["wall_in_profiler_ms"],
                             launches=pr["launches"])  # fmt: skip
            print(json.dumps(short), flush=True)
            for t in case.get("profile", {}).get("top", [])[:8]:
                print("   ", json.dumps(t), flush=True)
        rec["cublas_fp32"] = cublas_fp32(x)
        print(json.dumps(rec["cublas_fp32"]), flush=True)
        res[str(n)] = rec
        del x
        torch.cuda.empty_cache()
    (a.out / "policy_probe.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
