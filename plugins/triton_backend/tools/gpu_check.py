"""One-call GPU check of the triton backend: correctness, batch invariance, determinism, speed.

Usage on a CUDA machine (writes JSON to $OUT or --out):
    python plugins/triton_backend/tools/gpu_check.py [--quick] [--configs NAME,...]
On the CPU, ``--dry`` runs the same code paths at tiny shapes under TRITON_INTERPRET=1 (fp16
instead of bf16) to catch script errors before spending GPU time.

Speed is reported in GEMM units: one cuBLAS ``hidden @ weight.T`` of the same shape and dtype,
timed in the same process with ``triton.testing.do_bench`` (median). Peak extra memory is
``max_memory_allocated`` during forward + backward minus what was allocated before (the returned
gradients included).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, replace
from typing import Any

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--dry", action="store_true", help="CPU interpreter, tiny shapes")
ARGS.add_argument("--quick", action="store_true", help="fewer configs and shapes")
ARGS.add_argument("--configs", default="", help="comma-separated config names to benchmark")
ARGS.add_argument("--bench-n", default="8192,32768", help="token counts to benchmark")
ARGS.add_argument("--budget-s", type=float, default=240.0, help="stop benchmarking after this")
ARGS.add_argument(
    "--large-variants",
    default="default,blk128",
    help="backward variants timed at the larger token counts (the best at the first is added)",
)
ARGS.add_argument("--skip-variants", default="", help="variants not timed at the first token count")
ARGS.add_argument("--first-variants", default="", help="only these at the first token count")
ARGS.add_argument("--accuracy-variants", default="", help="accuracy of these variants too")
ARGS.add_argument("--profile", default="default@first", help="VARIANT@N (first: the first count)")
ARGS.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder")
OPTS = ARGS.parse_args()
if OPTS.dry:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from fusedhead.protocol import call_backend  # noqa: E402
from fusedhead.reference import reference_fused_head  # noqa: E402
from fusedhead_triton import TritonBackend, TritonOptions  # noqa: E402
from fusedhead_triton import backend as backend_mod  # noqa: E402
from fusedhead_triton.configs import BackendConfigs, TileConfig, default_configs  # noqa: E402

T0 = time.time()
DEV = torch.device("cpu" if OPTS.dry else "cuda")
LOW = torch.float16 if OPTS.dry else torch.bfloat16
RESULTS: dict[str, Any] = {}
ORIG_DEFAULTS = default_configs

_B = TileConfig(block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3)
_T = replace(_B, tma=True)
#: Forward candidates (forward-only timing); the first is the shipped default.
CANDIDATES: dict[str, TileConfig] = {
    "tma_128x256x64_g16_s3": _T,
    "tma_128x256x64_g8_s3": replace(_T, group_m=8),
    "ptr_128x256x64_g16_s3": _B,
}
#: Backward variants: (dz config, dh config, backend options), timed as forward + backward.
#: The first is the shipped default.
_TH = replace(_T, epilogue_splits=2)  # the shipped dh kernel
VARIANTS: dict[str, tuple[TileConfig, TileConfig, dict[str, Any]]] = {
    "default": (_T, _TH, {}),
    "whole_tile_epilogue": (_T, _T, {}),
    "cols16384": (_T, _T, {"backward_block_max_cols": 16384}),
    "blk128": (_T, _T, {"backward_block_mib": 128}),
    "dhcublas": (_T, _T, {"dh_gemm": "cublas"}),
    "dhtma_s4": (_T, replace(_T, num_stages=4), {}),
    "stash": (_T, _T, {"stash_dh_sum": True}),
    "stash_blk128": (_T, _T, {"stash_dh_sum": True, "backward_block_mib": 128}),
    "stash_blk64": (_T, _T, {"stash_dh_sum": True, "backward_block_mib": 64}),
    "stash_cublas": (_T, _T, {"stash_dh_sum": True, "dh_gemm": "cublas"}),
    "flat": (_T, replace(_T, flatten=True), {"dh_gemm": "triton"}),
    "halves": (_T, replace(_T, epilogue_splits=2), {"dh_gemm": "triton"}),
    "blk64": (_T, _T, {"backward_block_mib": 64}),
    "flat_blk64": (_T, replace(_T, flatten=True), {"backward_block_mib": 64}),
    "halves_blk64": (_T, replace(_T, epilogue_splits=2), {"backward_block_mib": 64}),
    "stash_flat_blk64": (
        _T,
        replace(_T, flatten=True),
        {"stash_dh_sum": True, "backward_block_mib": 64},
    ),
}
#: dh kernels for small dz budgets (many blocks: the running sum's read-modify-write dominates).
_DH_KERNELS: dict[str, TileConfig] = {
    "halves": replace(_T, epilogue_splits=2),
    "q128": replace(_T, block_n=128),
    "q128_p2": replace(_T, block_n=128, programs_per_sm=2),
    "q128_pre": replace(_T, block_n=128, prefetch_sum=True),
    "q128_p2_pre": replace(_T, block_n=128, programs_per_sm=2, prefetch_sum=True),
    "s4": replace(_T, epilogue_splits=4),
    "tsum1": replace(_T, tma_sum=True),
    "tsum2": replace(_T, epilogue_splits=2, tma_sum=True),
    "tsum4": replace(_T, epilogue_splits=4, tma_sum=True),
    # two programs per SM, each small enough for the pair to share it (registers, shared memory):
    # one's read-modify-write of the sum can overlap the other's MMAs
    "c8": replace(
        _T, block_n=128, num_stages=2, epilogue_splits=2, tma_sum=True, programs_per_sm=2
    ),
    "c8s3": replace(
        _T, block_n=128, num_stages=3, epilogue_splits=2, tma_sum=True, programs_per_sm=2
    ),
    "c4": replace(
        _T,
        block_n=128,
        num_warps=4,
        num_stages=2,
        epilogue_splits=2,
        tma_sum=True,
        programs_per_sm=2,
    ),
    "w64": replace(
        _T,
        block_m=64,
        num_warps=4,
        num_stages=2,
        epilogue_splits=2,
        tma_sum=True,
        programs_per_sm=2,
    ),
    "ws": replace(_TH, warp_specialize=True),
    "ws_whole": replace(_T, warp_specialize=True),
}
for _k, _dh in _DH_KERNELS.items():
    VARIANTS.setdefault(_k, (_T, _dh, {"dh_gemm": "triton"}))
    for _mib in (64, 80):
        VARIANTS.setdefault(f"{_k}_blk{_mib}", (_T, _dh, {"backward_block_mib": _mib}))
        VARIANTS[f"stash_{_k}_blk{_mib}"] = (
            _T, _dh, {"backward_block_mib": _mib, "stash_dh_sum": True}
        )  # fmt: skip
    VARIANTS[f"stash_{_k}"] = (_T, _dh, {"stash_dh_sum": True, "dh_gemm": "triton"})
if OPTS.dry:
    _small = dict(block_m=32, block_n=64, block_k=32)
    CANDIDATES = {k: replace(c, **_small) for k, c in list(CANDIDATES.items())[:2]}
    VARIANTS = {
        k: (replace(a, **_small), replace(b, **_small), {**o, "backward_block_mib": 0.01})
        for k, (a, b, o) in list(VARIANTS.items())[:3]
    }


def save() -> None:
    os.makedirs(OPTS.out, exist_ok=True)
    with open(os.path.join(OPTS.out, "gpu_check.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def log(*a: Any) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def use_configs(
    fwd: TileConfig | None, dz: TileConfig | None = None, dh: TileConfig | None = None
) -> None:
    """Make the backend use these 16-bit configs (fp32 keeps the shipped one)."""

    def pick(dtype: torch.dtype) -> BackendConfigs:
        base = ORIG_DEFAULTS(dtype)
        if dtype == torch.float32 or fwd is None:
            return base
        return BackendConfigs(forward=fwd, dz=dz or fwd, dh=dh or base.dh)

    backend_mod.default_configs = pick  # type: ignore[assignment]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-300))


def maxabs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def make(n: int, h: int, v: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> tuple:
    g = torch.Generator(device=DEV).manual_seed(seed)
    hid = torch.randn(n, h, generator=g, device=DEV).to(dtype)
    w = (torch.randn(v, h, generator=g, device=DEV) * (scale / h**0.5)).to(dtype)
    lab = torch.randint(0, v, (n,), generator=g, device=DEV)
    lab[torch.rand(n, generator=g, device=DEV) < 0.1] = -100
    return hid, w, lab


def call(be: TritonBackend, h, w, lab, *, temperature=0.7, softcap=None, entropy=True) -> tuple:
    return call_backend(be,
        h, w, lab, temperature=temperature, ignore_index=-100, return_entropy=entropy,
        process_group=None, vocab_start=0, vocab_size=w.shape[0], reduce_hidden_grad=True,
        softcap=softcap,
    )  # fmt: skip


def accuracy(name: str, n: int, hsz: int, v: int, dtype: torch.dtype, **kw: Any) -> None:
    """Forward and gradients against an fp32 (GPU) / fp64 (CPU) reference on the same values.

    ``variant=NAME`` runs a backward variant's configs and options instead of the defaults.
    """
    variant = kw.pop("variant", None)
    h, w, lab = make(n, hsz, v, dtype, scale=kw.pop("scale", 1.0))
    be = TritonBackend()
    if variant is not None:
        dz_cfg, dh_cfg, opts = VARIANTS[variant]
        use_configs(_T, dz_cfg, dh_cfg)
        be = TritonBackend(TritonOptions(**opts))
    hh = h.clone().requires_grad_()
    ww = w.clone().requires_grad_()
    lp, ent = call(be, hh, ww, lab, **kw)
    g1 = torch.randn(n, device=DEV)
    g2 = torch.randn(n, device=DEV)
    dh, dw = torch.autograd.grad((lp * g1 + ent * g2).sum(), [hh, ww])
    ref_dtype = torch.float64 if OPTS.dry else torch.float32
    hr = h.to(ref_dtype).requires_grad_()
    wr = w.to(ref_dtype).requires_grad_()
    temp = kw.get("temperature", 0.7)
    rl, re = reference_fused_head(
        hr, wr, lab, temperature=temp, softcap=kw.get("softcap"), compute_dtype=ref_dtype
    )
    rdh, rdw = torch.autograd.grad((rl * g1 + re * g2).sum(), [hr, wr])
    row = {
        "shape": [n, hsz, v],
        "dtype": str(dtype),
        "logp_rel": rel(lp, rl),
        "ent_rel": rel(ent, re),
        "logp_maxabs": maxabs(lp, rl),
        "ent_maxabs": maxabs(ent, re),
        "dh_rel": rel(dh, rdh),
        "dw_rel": rel(dw, rdw),
        "finite": bool(torch.isfinite(lp).all() and torch.isfinite(ent).all()),
        "logp_positive": int((lp > 0).sum()),
    }
    RESULTS.setdefault("accuracy", {})[name] = row
    log("acc", name, {k: (f"{x:.2e}" if isinstance(x, float) else x) for k, x in row.items()})
    if variant is not None:
        use_configs(None)
    del hr, wr, rl, re, rdh, rdw
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def invariance(n: int, hsz: int, v: int) -> None:
    """Bitwise batch invariance (permuted, sliced, single rows, larger batch) and determinism."""
    h, w, lab = make(n, hsz, v, LOW, seed=1)
    be = TritonBackend()
    temps = (torch.rand(n, device=DEV) + 0.5).float()
    out: dict[str, bool] = {}
    with torch.no_grad():
        for tname, temp in (("scalarT", 0.7), ("tokenT", temps)):
            lp, ent = call(be, h, w, lab, temperature=temp)
            perm = torch.randperm(n, device=DEV)
            tp = temp[perm] if isinstance(temp, torch.Tensor) else temp
            lp2, ent2 = call(be, h[perm], w, lab[perm], temperature=tp)
            out[f"{tname}_permuted"] = torch.equal(lp2, lp[perm]) and torch.equal(ent2, ent[perm])
            a, b = 3, min(n, 3 + 257)
            ts = temp[a:b] if isinstance(temp, torch.Tensor) else temp
            lp3, ent3 = call(be, h[a:b], w, lab[a:b], temperature=ts)
            out[f"{tname}_sliced"] = torch.equal(lp3, lp[a:b]) and torch.equal(ent3, ent[a:b])
            ok = True
            for i in (0, 1, n // 2, n - 1):
                ti = temp[i : i + 1] if isinstance(temp, torch.Tensor) else temp
                lpi, enti = call(be, h[i : i + 1], w, lab[i : i + 1], temperature=ti)
                ok = ok and torch.equal(lpi, lp[i : i + 1]) and torch.equal(enti, ent[i : i + 1])
            out[f"{tname}_single_rows"] = ok
            h2, _, lab2 = make(n + 77, hsz, v, LOW, seed=2)
            big_h = torch.cat([h, h2])
            tb = temp
            if isinstance(temp, torch.Tensor):
                tb = torch.cat([temp, torch.rand(n + 77, device=DEV) + 0.5])
            lp4, ent4 = call(be, big_h, w, torch.cat([lab, lab2]), temperature=tb)
            out[f"{tname}_larger_batch"] = torch.equal(lp4[:n], lp) and torch.equal(ent4[:n], ent)
    hh = h.clone().requires_grad_()
    ww = w.clone().requires_grad_()
    g1 = torch.randn(n, device=DEV)
    g2 = torch.randn(n, device=DEV)
    grads = []
    for _ in range(2):
        lp, ent = call(be, hh, ww, lab)
        grads.append(torch.autograd.grad((lp * g1 + ent * g2).sum(), [hh, ww]))
    out["deterministic_dh"] = torch.equal(grads[0][0], grads[1][0])
    out["deterministic_dw"] = torch.equal(grads[0][1], grads[1][1])
    RESULTS["invariance"] = {"shape": [n, hsz, v], **out}
    log("invariance", out)


def timeit(fn: Any, rep: int) -> float:
    """Median milliseconds: do_bench on the GPU, a plain timer on the CPU (dry runs)."""
    if DEV.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))
    fn()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return sorted(ts)[1]


def bench_forward(name: str, cfg: TileConfig, n: int, hsz: int, v: int) -> None:
    """Forward alone, in GEMM units."""
    use_configs(cfg)
    h, w, lab = make(n, hsz, v, LOW, seed=3)
    be = TritonBackend()
    rep = 50 if OPTS.dry else 300
    with torch.no_grad():
        unit = timeit(lambda: torch.mm(h, w.t()), rep)
        fwd = timeit(lambda: call(be, h, w, lab), rep)
    row = {"name": name, "config": asdict(cfg), "N": n, "unit_ms": unit, "fwd_ms": fwd}
    row["fwd_units"] = fwd / unit
    RESULTS.setdefault("forward", []).append(row)
    log("fwd", name, f"N={n} {fwd / unit:.3f} units (unit {unit:.2f} ms)")
    use_configs(None)


def bench_variant(name: str, fwd_cfg: TileConfig, n: int, hsz: int, v: int) -> None:
    """Forward + backward in GEMM units, and peak extra memory (grads included)."""
    dz_cfg, dh_cfg, opts = VARIANTS[name]
    use_configs(fwd_cfg, dz_cfg, dh_cfg)
    h, w, lab = make(n, hsz, v, LOW, seed=3)
    be = TritonBackend(TritonOptions(**opts))
    hh = h.clone().requires_grad_()
    ww = w.clone().requires_grad_()
    g1 = torch.randn(n, device=DEV)
    g2 = torch.randn(n, device=DEV)

    def step() -> Any:
        lp, ent = call(be, hh, ww, lab)
        return torch.autograd.grad((lp * g1 + ent * g2).sum(), [hh, ww])

    rep = 50 if OPTS.dry else 600
    with torch.no_grad():
        unit = timeit(lambda: torch.mm(h, w.t()), rep // 2)
    both = timeit(step, rep)
    row: dict[str, Any] = {"name": name, "N": n, "unit_ms": unit, "fwdbwd_ms": both}
    row.update(fwdbwd_units=both / unit, dz=asdict(dz_cfg), dh=asdict(dh_cfg), opts=opts)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        lp, ent = call(be, hh, ww, lab)
        hh.grad, ww.grad = torch.autograd.grad((lp * g1 + ent * g2).sum(), [hh, ww])
        torch.cuda.synchronize()
        row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        del lp, ent
        hh.grad = ww.grad = None
    RESULTS.setdefault("fwdbwd", []).append(row)
    save()
    log("fwd+bwd", name, f"N={n} {row['fwdbwd_units']:.3f} units",
        f"peak {row.get('peak_extra_gib', float('nan')):.3f} GiB (unit {unit:.2f} ms)")  # fmt: skip
    use_configs(None)


def kernel_resources() -> None:
    """Registers, spills and shared memory of every compiled kernel variant."""
    from fusedhead_triton import launch

    out: dict[str, list[dict[str, Any]]] = {}
    for mod in launch.kernels():
        for name in dir(mod):
            caches = getattr(getattr(mod, name), "device_caches", None)
            if not caches:
                continue
            for entry in caches.values():
                kcache = entry[0] if isinstance(entry, tuple) else entry
                for k in kcache.values():
                    meta = getattr(k, "metadata", None)
                    out.setdefault(name, []).append(
                        {
                            "n_regs": getattr(k, "n_regs", None),
                            "n_spills": getattr(k, "n_spills", None),
                            "shared": getattr(meta, "shared", None),
                            "warps": getattr(meta, "num_warps", None),
                        }
                    )
    RESULTS["kernels"] = out
    for name, rows in out.items():
        print(f"    {name}: " + ", ".join(f"{r['n_regs']}r/{r['n_spills']}sp" for r in rows))


def section(fn: Any, *a: Any, **kw: Any) -> None:
    try:
        fn(*a, **kw)
    except Exception as e:  # report and go on: one call must bring back all it can
        err = {"where": f"{fn.__name__}{a}", "error": f"{type(e).__name__}: {e}"}
        err["trace"] = traceback.format_exc()[-3000:]
        RESULTS.setdefault("errors", []).append(err)
        log("ERROR", fn.__name__, a, type(e).__name__, str(e)[:500])
    save()


def gaps(path: str) -> None:
    """GPU idle time between kernels in a chrome trace, and where the biggest gaps fall."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kern = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][:40])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e
    )
    launches = sorted(
        e["ts"] for e in events if e.get("cat") == "cuda_runtime" and "aunch" in e.get("name", "")
    )
    if not kern:
        return
    busy = sum(b - a for a, b, _ in kern)
    span = kern[-1][1] - kern[0][0]
    holes = []
    for (_, a1, an), (b0, _, bn) in itertools.pairwise(kern):
        if b0 - a1 > 20:
            # the last launch issued before the kernel started: CPU-bound if it is late
            issued = max((t for t in launches if t <= b0), default=None)
            holes.append((b0 - a1, an, bn, None if issued is None else b0 - issued))
    holes.sort(reverse=True)
    RESULTS["gaps"] = {
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": (span - busy) / 1e3,
        "top": holes[:15],
    }
    print(f"    trace: span {span / 1e3:.2f} ms, kernels busy {busy / 1e3:.2f} ms")
    for h in holes[:10]:
        print(f"      gap {h[0] / 1e3:7.3f} ms  {h[1]} -> {h[2]}  (launch {h[3]} us before)")


def profile_step(name: str, cfg: TileConfig, n: int, hsz: int, v: int) -> None:
    """GPU time per kernel for one forward + backward (torch.profiler), to place the time."""
    from torch.profiler import ProfilerActivity, profile

    dz_cfg, dh_cfg, opts = VARIANTS[name]
    use_configs(cfg, dz_cfg, dh_cfg)
    h, w, lab = make(n, hsz, v, LOW, seed=4)
    be = TritonBackend(TritonOptions(**opts))
    hh = h.clone().requires_grad_()
    ww = w.clone().requires_grad_()
    g1 = torch.randn(n, device=DEV)
    g2 = torch.randn(n, device=DEV)

    def step() -> Any:
        lp, ent = call(be, hh, ww, lab)
        return torch.autograd.grad((lp * g1 + ent * g2).sum(), [hh, ww])

    for _ in range(max(3, int(1500 / max(1.0, n / 8192 * 60)))):  # ~1.5 s: clocks as in do_bench
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    path = os.path.join(OPTS.out, "trace.json")
    prof.export_chrome_trace(path)
    gaps(path)
    rows = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            rows[e.key[:80]] = {"ms": t / 1e3, "calls": e.count}
    top = dict(sorted(rows.items(), key=lambda kv: -kv[1]["ms"])[:12])
    with torch.no_grad():
        unit = timeit(lambda: torch.mm(h, w.t()), 200)
    RESULTS["profile"] = {"variant": name, "N": n, "unit_ms": unit, "kernels": top}
    log(f"profile (unit {unit:.2f} ms)")
    for k, r in top.items():
        print(f"    {r['ms']:9.2f} ms  x{r['calls']:4d}  {k}")
    use_configs(None)


def main() -> None:
    RESULTS["env"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if DEV.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "dry": OPTS.dry,
        # the tree the GPU machine ran (scripts/gpu/stamp.sh; its copy of .git can be stale)
        "git_commit": os.environ.get("FUSEDHEAD_GIT_COMMIT"),
    }
    log(RESULTS["env"])
    if OPTS.dry:
        shapes = {"main": (70, 96, 1000), "ragged": (37, 100, 777)}
        inv = (50, 64, 700)
        bench_shapes = [(64, 64, 512)]
    else:
        shapes = {
            "main_8192": (8192, 4096, 151936),
            "qwen7b_1937": (1937, 3584, 152064),
            "qwen05b_2169": (2169, 896, 151936),
            "single_row": (1, 4096, 151936),
            "gpt2_4099": (4099, 1000, 50257),
        }
        inv = (2048, 4096, 151936)
        bench_shapes = [(int(x), 4096, 151936) for x in OPTS.bench_n.split(",")]
    if OPTS.quick:  # accuracy is also covered by tests/triton_backend/test_triton_gpu.py
        shapes = dict(list(shapes.items())[:1])
    for name, shp in shapes.items():
        section(accuracy, name, *shp, LOW)
    for vname in [x for x in OPTS.accuracy_variants.split(",") if x]:
        section(accuracy, f"{vname}@{next(iter(shapes))}", *next(iter(shapes.values())), LOW,
                variant=vname)  # fmt: skip
    mid = (96, 80, 900) if OPTS.dry else (1024, 1000, 50257)
    if not OPTS.quick:
        section(accuracy, "peaked_s4", *mid, LOW, scale=4.0)
        section(accuracy, "softcap30_tokenT", *mid, LOW, softcap=30.0,
                temperature=(torch.rand(mid[0], device=DEV) + 0.5))  # fmt: skip
        section(accuracy, "fp16", *mid, torch.float16)
        section(accuracy, "fp32", *mid, torch.float32)
    section(invariance, *inv)
    names = [s for s in OPTS.configs.split(",") if s] or list(CANDIDATES)
    if OPTS.quick:
        names = names[:1]
    first = bench_shapes[0]
    for name in names:
        section(bench_forward, name, CANDIDATES[name], *first)
    fwd_rows = RESULTS.get("forward", [])
    best = min(fwd_rows, key=lambda r: r["fwd_units"])["name"] if fwd_rows else names[0]
    RESULTS["best_forward"] = best
    skip = {x for x in OPTS.skip_variants.split(",") if x}
    only = [x for x in OPTS.first_variants.split(",") if x]
    for vname in only or VARIANTS:
        if vname in skip:
            continue
        if time.time() - T0 > OPTS.budget_s:
            log("budget reached, skipping", vname)
            break
        section(bench_variant, vname, CANDIDATES[best], *first)
    rows = [r for r in RESULTS.get("fwdbwd", []) if r["N"] == first[0]]
    best_v = min(rows, key=lambda r: r["fwdbwd_units"])["name"] if rows else next(iter(VARIANTS))
    RESULTS["best_variant"] = best_v
    section(kernel_resources)
    pvar, _, pn = OPTS.profile.partition("@")
    pshape = first if pn in ("", "first") else (int(pn), first[1], first[2])
    if DEV.type == "cuda" and pvar in VARIANTS:
        section(profile_step, pvar, CANDIDATES[best], *pshape)
    large = [x for x in OPTS.large_variants.split(",") if x]
    for n, hsz, v in bench_shapes[1:]:
        for vname in dict.fromkeys([*large, best_v]):
            if vname in VARIANTS and time.time() - T0 < OPTS.budget_s + 60:
                section(bench_variant, vname, CANDIDATES[best], n, hsz, v)
    save()
    log("summary")
    for r in RESULTS.get("forward", []):
        print(
            f"  fwd     {r['name']:26s} N={r['N']:6d} {r['fwd_units']:.3f} u  unit {r['unit_ms']:.2f} ms"
        )
    for r in RESULTS.get("fwdbwd", []):
        print(f"  fwd+bwd {r['name']:26s} N={r['N']:6d} {r['fwdbwd_units']:.3f} u  "
              f"peak {r.get('peak_extra_gib', float('nan')):.3f} GiB  unit {r['unit_ms']:.2f} ms")  # fmt: skip
    for k, r in RESULTS.get("accuracy", {}).items():
        print(f"  acc {k:18s} lp {r['logp_rel']:.1e} ent {r['ent_rel']:.1e} "
              f"dh {r['dh_rel']:.1e} dw {r['dw_rel']:.1e}")  # fmt: skip
    print("  invariance", RESULTS.get("invariance"))
    print("  errors", len(RESULTS.get("errors", [])))


if __name__ == "__main__":
    main()
