"""Check the ``liger`` backend against liger-kernel called directly, on one GPU; write JSON.

    python plugins/liger_backend/tools/gpu_check.py OUT.json                 # H200, bf16, native
    python plugins/liger_backend/tools/gpu_check.py OUT.json --dry-run       # CPU, fp32, fallback, small

Sections (each recorded even when another fails, the JSON rewritten after each):
  env            versions, device
  describe       what ``LigerBackend.describe`` says about this device
  fp32_refused   native + fp32 inputs: our BackendUnavailableError, where Liger raises TypeError
  bitwise        adapter outputs == Liger direct (0 - nll, entropy upcast), forward and gradients
  accuracy       adapter against an fp32 full-logits reference on the same values (s=1 and s=4)
  timing         triton do_bench medians, adapter vs Liger direct, interleaved rounds (<= 3 %)
  memory         peak extra memory of forward + backward, adapter vs Liger direct
  determinism    two adapter runs, same bits?
Exit status 0 when every required check passed (fp32_refused, bitwise forward, timing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from fusedhead.protocol import call_backend

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IGNORE_INDEX = -100
OVERHEAD_LIMIT = 0.03


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out", type=Path, help="JSON file to write")
    p.add_argument("--device", default="cuda")
    p.add_argument("--impl", choices=("native", "fallback"), default="native")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--h", type=int, default=4096)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--rep-ms", type=int, default=1000, help="do_bench rep per measurement")
    p.add_argument("--ref-chunk", type=int, default=1024, help="rows per fp32 reference chunk")
    p.add_argument(
        "--sections", default="", help="comma-separated subset of sections (default: all)"
    )
    p.add_argument("--dry-run", action="store_true", help="CPU, fp32, fallback, N=600 H=64 V=1000")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.impl, args.dtype = "cpu", "fallback", "fp32"
        args.n, args.h, args.v = 600, 64, 1000
        args.rounds, args.rep_ms, args.ref_chunk = 2, 50, 256
        # One CPU thread: a reduction split over however many OpenMP threads a call gets is not
        # bitwise run to run (entropy 3.5e-5 apart about once in twelve runs at 2 threads), and
        # the bitwise section compares two runs. The GPU run is what the section is for.
        torch.set_num_threads(1)
    return args


# ----------------------------------------------------------------------------- inputs


def make_inputs(
    n: int, h: int, v: int, scale: float, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """docs/design.md's inputs: h ~ N(0,1), W ~ N(0,(s/sqrt(H))^2), a tenth of labels ignored; upstream grads.

    Drawn on the device itself (a 151936 x 4096 weight takes seconds to draw on a CPU).
    """
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    hidden = randn(n, h)
    weight = randn(v, h).mul_(scale / h**0.5)
    labels = torch.randint(0, v, (n,), generator=gen, device=device)
    labels[torch.rand(n, generator=gen, device=device) < 0.1] = IGNORE_INDEX
    return {
        "hidden": hidden.to(dtype),
        "weight": weight.to(dtype),
        "labels": labels,
        "g_lp": randn(n),
        "g_ent": randn(n),
    }


# ----------------------------------------------------------------------------- the two callers


def make_backend(impl: str) -> Any:
    from fusedhead_liger import LigerBackend, LigerOptions

    return LigerBackend(LigerOptions(implementation=impl))


def adapter_call(
    backend: Any,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the core hands the backend (2-D, resolved vocab range)."""
    lp, ent = call_backend(
        backend,
        hidden,
        weight,
        labels,
        temperature=temperature,
        ignore_index=IGNORE_INDEX,
        return_entropy=True,
        process_group=None,
        vocab_start=0,
        vocab_size=weight.shape[0],
        reduce_hidden_grad=True,
    )
    assert ent is not None
    return lp, ent


def direct_function(impl: str, device: torch.device) -> tuple[Callable[..., Any], str]:
    """Liger as a user calls it: its public dispatcher when that picks the adapter's function."""
    from liger_kernel.ops import fused_linear_scaled_cross_entropy as m

    from fusedhead_liger import _liger

    ours = _liger.native_function() if impl == "native" else _liger.fallback_function()
    picked = m._resolve_implementation(device)
    if picked is ours:
        return m.LigerFusedLinearScaledCrossEntropyFunction.apply, (
            f"LigerFusedLinearScaledCrossEntropyFunction.apply (dispatches to {ours.__name__})"
        )
    # Liger's dispatcher would pick something else here (fallback on a GPU): call ours directly.
    if impl == "native":
        return (
            lambda h, w, y, t, ii, m_tiles, ent: ours.apply(h, w, y, t, ii, m_tiles, ent)
        ), ours.__name__
    return (lambda h, w, y, t, ii, _m_tiles, ent: ours.apply(h, w, y, t, ii, ent)), ours.__name__


def direct_call(
    fn: Callable[..., Any],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Liger's raw outputs: (nll fp32, entropy in Liger's dtype)."""
    nll, ent = fn(hidden, weight, labels, temperature, IGNORE_INDEX, 1, True)
    return nll, ent


def adapter_step(
    backend: Any, x: dict[str, torch.Tensor], h: torch.Tensor, w: torch.Tensor, t: float
) -> tuple[torch.Tensor, ...]:
    """Forward + backward through the adapter: (log_probs, entropy, dh, dW)."""
    lp, ent = adapter_call(backend, h, w, x["labels"], t)
    dh, dw = torch.autograd.grad((lp, ent), (h, w), (x["g_lp"], x["g_ent"]))
    return lp.detach(), ent.detach(), dh, dw


def direct_step(
    fn: Callable[..., Any], x: dict[str, torch.Tensor], h: torch.Tensor, w: torch.Tensor, t: float
) -> tuple[torch.Tensor, ...]:
    """Forward + backward through Liger direct with the same upstream grads: (0 - nll, entropy fp32,
    dh, dW); ``0 - nll``, as the adapter maps it, makes an ignored row's 0 a +0.0.

    Liger gets the hidden states the adapter hands it: the ignored rows selected to zeros
    (``fusedhead_liger._run.liger_inputs``), so that a row's values may depend on the others' as
    Liger's chunks compute them (a CI run saw the entropy differ by 3.5e-5 with the raw rows).
    """
    keep = (x["labels"] != IGNORE_INDEX).unsqueeze(1)
    h_in = torch.where(keep, h, torch.zeros((), dtype=h.dtype, device=h.device))
    nll, ent = direct_call(fn, h_in, w, x["labels"], t)
    dh, dw = torch.autograd.grad((nll, ent), (h, w), (x["g_lp"].neg(), x["g_ent"].to(ent.dtype)))
    return 0.0 - nll.detach(), ent.detach().float(), dh, dw


# ----------------------------------------------------------------------------- measures


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN, -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.contiguous(), b.contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.view(ints), b.view(ints)))


def errors(a: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """docs/design.md's measures: relative L2 error over the tensor and max abs error."""
    a64, r64 = a.double(), ref.double()
    diff = a64 - r64
    return {
        "rel": float(diff.norm() / r64.norm().clamp_min(1e-300)),
        "max_abs": float(diff.abs().max()),
    }


def fp32_reference(x: dict[str, torch.Tensor], t: float, chunk: int) -> dict[str, torch.Tensor]:
    """Full-logits fp32 reference on the same values, row-chunked; forward and both gradients."""
    from fusedhead.reference import reference_fused_head

    w = x["weight"].float().requires_grad_()
    lps, ents, dhs = [], [], []
    n = x["hidden"].shape[0]
    for s in range(0, n, chunk):
        h = x["hidden"][s : s + chunk].float().requires_grad_()
        lp, ent = reference_fused_head(
            h,
            w,
            x["labels"][s : s + chunk],
            temperature=t,
            ignore_index=IGNORE_INDEX,
            compute_dtype=torch.float32,
        )
        assert ent is not None
        torch.autograd.backward((lp, ent), (x["g_lp"][s : s + chunk], x["g_ent"][s : s + chunk]))
        lps.append(lp.detach())
        ents.append(ent.detach())
        dhs.append(h.grad)
    assert w.grad is not None
    return {
        "log_probs": torch.cat(lps),
        "entropy": torch.cat(ents),
        "dh": torch.cat(dhs),
        "dw": w.grad,
    }


def bench(fn: Callable[[], Any], device: torch.device, rep_ms: int) -> float:
    """Median time of fn in ms: triton's do_bench on CUDA, a wall-clock median on the CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=max(25, rep_ms // 10), rep=rep_ms, return_mode="median"))
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1000
    while len(times) < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- sections


class Report:
    """The JSON document, rewritten atomically after every section."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "sections": {},
        }

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[dict[str, Any]]:
        entry: dict[str, Any] = {}
        self.data["sections"][name] = entry
        t0 = time.perf_counter()
        try:
            yield entry
        except Exception as exc:
            entry["ok"] = False
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        print(f"[gpu_check] {name}: ok={entry.get('ok')} ({entry['seconds']} s)", flush=True)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)


def env_section(entry: dict[str, Any], device: torch.device) -> None:
    import importlib.metadata as md

    def ver(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    entry["python"] = platform.python_version()
    entry["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    entry["torch"] = torch.__version__
    entry["cuda"] = torch.version.cuda
    for dist in (
        "triton",
        "liger-kernel",
        "nvidia-cutlass-dsl",
        "nvidia-cutlass-dsl-libs-cu13",
        "apache-tvm-ffi",
        "fusedhead",
        "fusedhead-liger",
    ):
        entry[dist] = ver(dist)
    if device.type == "cuda":
        entry["device_name"] = torch.cuda.get_device_name(device)
        entry["capability"] = list(torch.cuda.get_device_capability(device))
    entry["ok"] = True


def fp32_refused_section(
    entry: dict[str, Any], args: argparse.Namespace, device: torch.device
) -> None:
    """Native with fp32 inputs: our clear error, where Liger's own call raises TypeError."""
    from fusedhead.errors import BackendUnavailableError

    x = make_inputs(256, 128, 1000, 1.0, torch.float32, device)
    backend = make_backend("native")
    try:
        adapter_call(backend, x["hidden"], x["weight"], x["labels"], args.temperature)
    except BackendUnavailableError as exc:
        entry["adapter_error"] = f"{type(exc).__name__}: {exc}"
        entry["ok"] = "fallback" in str(exc) and "bfloat16" in str(exc)
    else:
        entry["adapter_error"] = None
        entry["ok"] = False
    try:
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
            LigerFusedLinearScaledCrossEntropyFunction,
        )

        LigerFusedLinearScaledCrossEntropyFunction.apply(
            x["hidden"], x["weight"], x["labels"], args.temperature, IGNORE_INDEX, 1, True
        )
        entry["liger_direct"] = "ran (Liger dispatched to its fallback)"
    except Exception as exc:
        entry["liger_direct"] = f"{type(exc).__name__}: {exc}"


def bitwise_section(
    entry: dict[str, Any], args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> None:
    backend = make_backend(args.impl)
    fn, entry["direct"] = direct_function(args.impl, device)
    x = make_inputs(args.n, args.h, args.v, 1.0, dtype, device)
    h = x["hidden"].detach().requires_grad_()
    w = x["weight"].detach().requires_grad_()
    ours = adapter_step(backend, x, h, w, args.temperature)
    sync(device)
    theirs = direct_step(fn, x, h, w, args.temperature)
    theirs_again = direct_step(fn, x, h, w, args.temperature)
    sync(device)
    names = ("log_probs", "entropy", "dh", "dw")
    entry["dtypes"] = {n: str(t.dtype) for n, t in zip(names, ours)}
    entry["equal"] = {n: same_bits(a, b) for n, a, b in zip(names, ours, theirs)}
    entry["direct_run_to_run_equal"] = {
        n: same_bits(a, b) for n, a, b in zip(names, theirs, theirs_again)
    }
    entry["max_abs_diff"] = {
        n: float((a.double() - b.double()).abs().max()) for n, a, b in zip(names, ours, theirs)
    }
    entry["forward_equal"] = entry["equal"]["log_probs"] and entry["equal"]["entropy"]
    # Gradients can only be bitwise equal if Liger's own backward is run-to-run deterministic,
    # and where the adapter hands Liger the upstream gradients as autograd would: the fallback
    # gives fp16/bf16 entropy's upstream gradient to Liger in fp32 (``_run.adapted``).
    grads_expected_equal = all(entry["direct_run_to_run_equal"][n] for n in ("dh", "dw")) and (
        args.impl == "native" or dtype == torch.float32
    )
    entry["grads_equal"] = entry["equal"]["dh"] and entry["equal"]["dw"]
    entry["ok"] = entry["forward_equal"] and (entry["grads_equal"] or not grads_expected_equal)


def accuracy_section(
    entry: dict[str, Any], args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> None:
    backend = make_backend(args.impl)
    for scale in (1.0, 4.0):
        x = make_inputs(args.n, args.h, args.v, scale, dtype, device, seed=1)
        h = x["hidden"].detach().requires_grad_()
        w = x["weight"].detach().requires_grad_()
        lp, ent, dh, dw = adapter_step(backend, x, h, w, args.temperature)
        del h, w
        ref = fp32_reference(x, args.temperature, args.ref_chunk)
        valid = x["labels"] != IGNORE_INDEX
        entry[f"s={scale:g}"] = {
            "log_probs": errors(lp[valid], ref["log_probs"][valid]),
            "entropy": errors(ent[valid], ref["entropy"][valid]),
            "dh": errors(dh, ref["dh"]),
            "dw": errors(dw, ref["dw"]),
            "ignored_rows_zero": bool((lp[~valid] == 0).all() and (ent[~valid] == 0).all()),
            "finite": bool(torch.isfinite(lp).all() and torch.isfinite(ent).all()),
        }
        del ref, lp, ent, dh, dw, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    entry["ok"] = all(entry[k]["finite"] and entry[k]["ignored_rows_zero"] for k in ("s=1", "s=4"))


def timing_section(
    entry: dict[str, Any], args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> None:
    backend = make_backend(args.impl)
    fn, entry["direct"] = direct_function(args.impl, device)
    x = make_inputs(args.n, args.h, args.v, 1.0, dtype, device)
    h = x["hidden"].detach().requires_grad_()
    w = x["weight"].detach().requires_grad_()
    t = args.temperature
    cases: dict[str, Callable[[], Any]] = {
        "gemm": lambda: x["hidden"] @ x["weight"].T,
        "adapter_fwd": lambda: adapter_call(backend, h, w, x["labels"], t),
        "direct_fwd": lambda: direct_call(fn, h, w, x["labels"], t),
        "adapter_fwd_bwd": lambda: adapter_step(backend, x, h, w, t),
        "direct_fwd_bwd": lambda: direct_step(fn, x, h, w, t),
    }
    try:
        from fusedhead.api import fused_head

        opts = {"implementation": args.impl}
        cases["core_fwd_bwd"] = lambda: torch.autograd.grad(
            fused_head(
                h, w, x["labels"], backend="liger", temperature=t, options=opts, check_labels=False
            ),
            (h, w),
            (x["g_lp"], x["g_ent"]),
        )
    except ImportError as exc:
        entry["core"] = f"not measured: {exc}"
    rounds: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            rounds[name].append(bench(case, device, args.rep_ms))
    entry["rounds_ms"] = rounds
    med = {k: statistics.median(v) for k, v in rounds.items()}
    entry["median_ms"] = med
    entry["gemm_units"] = {k: v / med["gemm"] for k, v in med.items()}
    entry["overhead"] = {
        "fwd": med["adapter_fwd"] / med["direct_fwd"] - 1,
        "fwd_bwd": med["adapter_fwd_bwd"] / med["direct_fwd_bwd"] - 1,
    }
    if "core_fwd_bwd" in med:
        entry["overhead"]["core_fwd_bwd"] = med["core_fwd_bwd"] / med["direct_fwd_bwd"] - 1
    entry["limit"] = OVERHEAD_LIMIT
    within = (
        entry["overhead"]["fwd"] <= OVERHEAD_LIMIT
        and entry["overhead"]["fwd_bwd"] <= OVERHEAD_LIMIT
    )
    # Wall-clock medians on a shared CPU are too noisy for a 3 % verdict: informative only there.
    entry["ok"] = within if device.type == "cuda" else None


def memory_section(
    entry: dict[str, Any], args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> None:
    if device.type != "cuda":
        entry["ok"] = None
        entry["skipped"] = "CUDA only"
        return
    backend = make_backend(args.impl)
    fn, _ = direct_function(args.impl, device)
    x = make_inputs(args.n, args.h, args.v, 1.0, dtype, device)
    h = x["hidden"].detach().requires_grad_()
    w = x["weight"].detach().requires_grad_()
    steps = {
        "adapter": lambda: adapter_step(backend, x, h, w, args.temperature),
        "direct": lambda: direct_step(fn, x, h, w, args.temperature),
    }
    for name, step in steps.items():
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = step()
        torch.cuda.synchronize(device)
        entry[f"{name}_peak_extra_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
        del out
    entry["ok"] = True


def determinism_section(
    entry: dict[str, Any], args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> None:
    backend = make_backend(args.impl)
    x = make_inputs(args.n, args.h, args.v, 1.0, dtype, device)
    h = x["hidden"].detach().requires_grad_()
    w = x["weight"].detach().requires_grad_()
    a = adapter_step(backend, x, h, w, args.temperature)
    b = adapter_step(backend, x, h, w, args.temperature)
    entry["equal"] = {
        n: same_bits(p, q) for n, p, q in zip(("log_probs", "entropy", "dh", "dw"), a, b)
    }
    entry["ok"] = True  # informative: the backend declares deterministic=False


def describe_section(
    entry: dict[str, Any], args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> None:
    entry.update(make_backend(args.impl).describe(device, dtype))
    entry["ok"] = entry["would_run"] == "yes"


SECTIONS: dict[str, Callable[..., None]] = {
    "describe": describe_section,
    "fp32_refused": lambda e, a, d, _t: fp32_refused_section(e, a, d),
    "bitwise": bitwise_section,
    "accuracy": accuracy_section,
    "timing": timing_section,
    "memory": memory_section,
    "determinism": determinism_section,
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    wanted = args.sections.split(",") if args.sections else list(SECTIONS)
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    if not (args.impl == "native" and device.type == "cuda") and "fp32_refused" in wanted:
        wanted.remove("fp32_refused")  # the refusal is about native on a GPU
    report = Report(args.out, args)
    with report.section("env") as e:
        env_section(e, device)
    for name in wanted:
        with report.section(name) as e:
            SECTIONS[name](e, args, device, dtype)
    required = ["describe", "bitwise", "accuracy", "fp32_refused"]
    required += ["timing"] if device.type == "cuda" else []
    report.data["required"] = [s for s in required if s in wanted]
    report.data["passed"] = all(
        report.data["sections"][s].get("ok") is True for s in report.data["required"]
    )
    report.write()
    print(f"[gpu_check] passed={report.data['passed']} -> {args.out}", flush=True)
    return 0 if report.data["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
