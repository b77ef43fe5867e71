"""Issue 15: the LM-head part of TRL's GRPO step, fusedhead ``triton`` against TRL's own kernel.

    python scripts/gpu/trl_grpo_bench.py OUT_DIR                 # one GPU, bf16, full size
    python scripts/gpu/trl_grpo_bench.py OUT_DIR --device cpu --small --backend torch   # smoke

What GRPO computes per micro-batch for its policy: ``model(..., labels=labels, fused_lm_head=True)``
runs the backbone, then the LM head on the completion positions only, for per-token log-probs and
entropy, and the loss backpropagates through both. The backbone is the same whichever head runs,
so this times the head exactly as the two paths call it, on one Qwen2-shaped head (H = 4096,
V = 151936, no bias, bf16) and ``[B, T, H]`` hidden states whose prompt positions are ignored:

- ``trl``: ``ChunkedLogProbFunction`` on the compacted rows, as ``add_fused_lm_head`` calls it
  (vocabulary chunk 32768, outputs log_probs and entropy), scattered back;
- ``fusedhead``: ``fusedhead.integrations.lm_head.lm_head_logprobs`` (what
  ``fusedhead.integrations.trl`` runs) with the named backend.

For each: the forward alone and forward + backward (upstream gradients on log-probs and
entropy, as GRPO's loss and entropy metric give), median time over repeats (CUDA events),
peak memory above the inputs, and the log-prob / entropy error on a slice of rows against float64
logits (``fusedhead.reference``; a float32 reference is itself a float32 computation: on an AVX2
CPU one run's float32 entropy was 1.8e-4 off in a row where both heads agreed to 1e-6). Writes ``OUT_DIR/trl_grpo_bench.json`` and prints a table.

TRL need not be installed with its dependencies: ``pip install --no-deps trl==1.16.0`` (pure
Python) is enough. If ``trl.trainer.utils`` cannot be imported (accelerate, datasets, ... absent),
the kernel file is loaded on its own, with the one TRL helper its backward imports (the ZeRO-3
gather, a no-op on one GPU) provided here, and, without transformers, the one function it imports
from it (``is_triton_available``); ``--standalone-trl`` forces loading the file alone.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

CHUNK = 32768  # TRL's vocabulary chunk in add_fused_lm_head (_CHUNKED_LOGPROB_CHUNK_SIZE)
OUTPUTS = ("log_probs", "entropy")


def load_trl_kernel(standalone: bool) -> tuple[Any, str]:
    """TRL's ``ChunkedLogProbFunction`` and how it was loaded."""
    if not standalone:
        try:
            import trl.trainer.utils  # noqa: F401  (the kernel's backward imports it)
            from trl.kernels.chunked_logprob import ChunkedLogProbFunction

            return ChunkedLogProbFunction, "trl, installed with its dependencies"
        except ImportError as exc:
            print(f"trl.trainer.utils is not importable ({exc}); loading TRL's kernel file alone")
    for name in [m for m in sys.modules if m == "trl" or m.startswith("trl.")]:
        del sys.modules[name]
    spec = importlib.util.find_spec("trl")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "TRL is not installed: pip install --no-deps trl==1.16.0 (pure Python; its kernel needs "
            "only torch and packaging here)"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    kernel = root / "kernels" / "chunked_logprob.py"
    if not kernel.is_file():
        raise SystemExit(
            f"{kernel} not found: this bench was written against TRL 1.16 (trl/kernels)"
        )
    if importlib.util.find_spec("transformers") is None:
        # The kernel file needs one function from transformers: whether Triton can be imported.
        print(
            "transformers is not installed: giving TRL's kernel transformers.utils.is_triton_available"
        )
        tf = types.ModuleType("transformers")
        tf.__path__ = []
        tf_utils = types.ModuleType("transformers.utils")
        tf_utils.is_triton_available = lambda: importlib.util.find_spec("triton") is not None  # type: ignore[attr-defined]
        sys.modules["transformers"], sys.modules["transformers.utils"] = tf, tf_utils
    for name, path in (
        ("trl", root),
        ("trl.kernels", root / "kernels"),
        ("trl.trainer", root / "trainer"),
    ):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    utils = types.ModuleType("trl.trainer.utils")
    # The kernel's backward enters this to all-gather ZeRO-3 shards; on one GPU there are none.
    utils.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()  # type: ignore[attr-defined]
    sys.modules["trl.trainer.utils"] = utils
    kspec = importlib.util.spec_from_file_location("trl.kernels.chunked_logprob", kernel)
    assert kspec is not None and kspec.loader is not None
    module = importlib.util.module_from_spec(kspec)
    sys.modules["trl.kernels.chunked_logprob"] = module
    kspec.loader.exec_module(module)
    return module.ChunkedLogProbFunction, f"{kernel} loaded alone (no TRL dependencies)"


def trl_head(fn: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The head as TRL's fused forward runs it: compacted rows, then scattered back."""

    def run(
        lm_head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mask = labels != -100
        lp, ent, *_ = fn.apply(
            hidden[mask],
            lm_head.weight,
            lm_head.bias,
            labels[mask],
            temperature,
            CHUNK,
            None,
            1.0,
            OUTPUTS,
        )
        return (
            lp.new_zeros(mask.shape).masked_scatter(mask, lp),
            ent.new_zeros(mask.shape).masked_scatter(mask, ent),
        )

    return run


def fusedhead_head(backend: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    from fusedhead.integrations.lm_head import lm_head_logprobs, resolve_lm_head

    head = resolve_lm_head(backend)

    def run(
        lm_head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = lm_head_logprobs(lm_head, hidden, labels, head=head, temperature=temperature)
        assert out.entropy is not None
        return out.log_probs, out.entropy

    return run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int
) -> dict[str, Any]:
    """Median milliseconds over ``repeats`` calls and the peak memory above what existed before."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    peak = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    return {
        "ms_median": statistics.median(times),
        "ms_min": min(times),
        "ms_all": times,
        "peak_extra_gib": peak,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="triton", help="fusedhead backend name (default triton)")
    p.add_argument("--small", action="store_true", help="tiny shapes, float32 (a smoke run)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1536)
    p.add_argument("--prompt", type=int, default=512, help="ignored (prompt) positions per row")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--check-rows", type=int, default=1024)
    p.add_argument("--standalone-trl", action="store_true", help="load TRL's kernel file alone")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu --small for the smoke run")
    if args.small:
        H, V, dtype = 64, 1000, torch.float32
        B, T, prompt = 2, 48, 16
        args.warmup, args.repeats, args.check_rows = 1, 2, 32
    else:
        H, V, dtype = 4096, 151936, torch.bfloat16
        B, T, prompt = args.batch, args.seq, args.prompt
    fn, how = load_trl_kernel(args.standalone_trl)
    g = torch.Generator(device="cpu").manual_seed(0)
    lm_head = nn.Linear(H, V, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        w = torch.randn(V, H, generator=g) / math.sqrt(H) * 2.0
        lm_head.weight.copy_(w.to(device=device, dtype=dtype))
        del w
    hidden = torch.randn(B, T, H, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
    labels = torch.randint(0, V, (B, T), generator=g).to(device)
    labels[:, :prompt] = -100
    g_lp = torch.randn(B, T, generator=g).to(device)
    g_ent = torch.randn(B, T, generator=g).to(device) * 0.01
    scored = int((labels != -100).sum())

    from fusedhead.reference import reference_fused_head

    # float64 reference on a slice of scored rows (full logits of those rows only)
    rows = (labels != -100).nonzero()[: args.check_rows]
    with torch.no_grad():
        ref_lp, ref_ent = reference_fused_head(
            hidden.detach()[rows[:, 0], rows[:, 1]],
            lm_head.weight,
            labels[rows[:, 0], rows[:, 1]],
            temperature=args.temperature,
            compute_dtype=torch.float64,
        )
        assert ref_ent is not None

    impls = {"trl": trl_head(fn), "fusedhead": fusedhead_head(args.backend)}
    results: dict[str, Any] = {}
    grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, run in impls.items():

        def forward(run: Callable[..., Any] = run) -> None:
            with torch.no_grad():
                run(lm_head, hidden, labels, args.temperature)

        def step(run: Callable[..., Any] = run, keep: bool = False) -> None:
            lp, ent = run(lm_head, hidden, labels, args.temperature)
            ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
            if not keep:
                hidden.grad = None
                lm_head.weight.grad = None

        with torch.no_grad():
            lp, ent = run(lm_head, hidden, labels, args.temperature)
            got_lp = lp[rows[:, 0], rows[:, 1]].float()
            got_ent = ent[rows[:, 0], rows[:, 1]].float()
            outs[name] = (got_lp, got_ent)
        results[name] = {
            "forward": measure(forward, device, args.warmup, args.repeats),
            "forward_backward": measure(step, device, args.warmup, args.repeats),
            "logprob_max_abs_err": float((got_lp - ref_lp).abs().max()),
            "entropy_max_abs_err": float((got_ent - ref_ent).abs().max()),
        }
        del lp, ent
        step(keep=True)  # gradients of one step, compared across implementations below
        assert hidden.grad is not None and lm_head.weight.grad is not None
        grads[name] = (hidden.grad.float().cpu(), lm_head.weight.grad.float().cpu())
        hidden.grad = None
        lm_head.weight.grad = None

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    results["fusedhead"]["output_max_abs_diff_vs_trl"] = {
        "log_probs": float((outs["fusedhead"][0] - outs["trl"][0]).abs().max()),
        "entropy": float((outs["fusedhead"][1] - outs["trl"][1]).abs().max()),
    }
    results["fusedhead"]["grad_rel_diff_vs_trl"] = {
        "hidden": rel(grads["fusedhead"][0], grads["trl"][0]),
        "weight": rel(grads["fusedhead"][1], grads["trl"][1]),
    }

    record = {
        "what": "LM head of TRL's GRPO path: log-probs + entropy, forward and forward+backward",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "trl_kernel": how,
        "fusedhead_backend": args.backend,
        "shape": {"B": B, "T": T, "H": H, "V": V, "prompt": prompt, "scored_tokens": scored},
        "dtype": str(dtype).removeprefix("torch."),
        "temperature": args.temperature,
        "errors_against": "float64 logits of the checked rows (fusedhead.reference)",
        "check_rows": int(rows.shape[0]),
        "reference_max_abs": {
            "log_probs": float(ref_lp.abs().max()),
            "entropy": float(ref_ent.abs().max()),
        },
        "trl_vocab_chunk": CHUNK,
        "repeats": args.repeats,
        "results": results,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "trl_grpo_bench.json"
    out.write_text(json.dumps(record, indent=2) + "\n")

    print(f"{record['device']}, {record['dtype']}, B={B} T={T} H={H} V={V}, {scored} scored tokens")
    print(f"TRL kernel: {how}; fusedhead backend: {args.backend}")
    header = f"{'impl':<10} {'fwd ms':>9} {'fwd+bwd ms':>11} {'fwd GiB':>8} {'fwd+bwd GiB':>12} {'lp err':>9} {'ent err':>9}"
    print(header)
    for name, r in results.items():
        f, fb = r["forward"], r["forward_backward"]
        gib = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        print(
            f"{name:<10} {f['ms_median']:9.2f} {fb['ms_median']:11.2f} {gib(f['peak_extra_gib']):>8} "
            f"{gib(fb['peak_extra_gib']):>12} {r['logprob_max_abs_err']:9.2e} {r['entropy_max_abs_err']:9.2e}"
        )
    print(
        f"fusedhead vs trl gradients (relative L2): {results['fusedhead']['grad_rel_diff_vs_trl']}"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
