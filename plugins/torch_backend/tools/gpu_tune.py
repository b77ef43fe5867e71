"""Tune the torch backend's bf16 CUDA path at docs/design.md's GPU shape; prints one JSON per line.

    python plugins/torch_backend/tools/gpu_tune.py [--out DIR]

GEMM unit: one bf16 ``hidden @ weight.T`` of the case's shape (``triton.testing.do_bench``
median). Peak extra: ``max_memory_allocated`` during forward+backward minus what was allocated
before (inputs), so it includes the returned gradients. Errors: against the fp32 full-logits
reference on the same bf16 values (TF32 off). Variants swap the row-dot of the entropy sum and the
workspace budget; a profile of the default variant lists the kernels by CUDA time.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from triton.testing import do_bench

import fusedhead_torch.tile_math as tile_math
from fusedhead.protocol import call_backend
from fusedhead.reference import reference_fused_head
from fusedhead_torch import TorchBackend, TorchOptions

H, V, T = 4096, 151936, 0.7


def inputs(n: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) / math.sqrt(H)).bfloat16()
    labels = torch.randint(0, V, (n,), device="cuda", generator=g)
    labels[torch.randperm(n, device="cuda", generator=g)[: n // 10]] = -100
    return hidden, weight, labels


def call(backend, hidden, weight, labels, grad: bool):
    h = hidden.detach().requires_grad_(grad)
    w = weight.detach().requires_grad_(grad)
    lp, ent = call_backend(
        backend,
        h,
        w,
        labels,
        temperature=T,
        ignore_index=-100,
        return_entropy=True,
        process_group=None,
        vocab_start=0,
        vocab_size=V,
        reduce_hidden_grad=True,
    )
    if grad:
        (lp.sum() + ent.sum()).backward()
    return lp, ent, h.grad, w.grad


def bench(fn) -> float:
    return do_bench(fn, warmup=300, rep=1500, return_mode="median")


def peak_extra_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**30


def row_dot_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def row_dot_vecdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vecdot(a, b)


def errors(n: int, hidden, weight, labels, backend) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    g_lp = torch.randn(n, device="cuda", generator=g)
    g_ent = torch.randn(n, device="cuda", generator=g)

    def run(fn, h, w):
        h = h.detach().requires_grad_()
        w = w.detach().requires_grad_()
        lp, ent = fn(h, w)
        ((lp.float() * g_lp).sum() + (ent.float() * g_ent).sum()).backward()
        return lp.detach().float(), ent.detach().float(), h.grad.float(), w.grad.float()

    ref = run(
        lambda h, w: reference_fused_head(h, w, labels, temperature=T, compute_dtype=torch.float32),
        hidden.float(),
        weight.float(),
    )
    got = run(
        lambda h, w: call_backend(
            backend,
            h,
            w,
            labels,
            temperature=T,
            ignore_index=-100,
            return_entropy=True,
            process_group=None,
            vocab_start=0,
            vocab_size=V,
            reduce_hidden_grad=True,
        ),
        hidden,
        weight,
    )
    out = {}
    for name, a, b in zip(("log_prob", "entropy", "d_hidden", "d_weight"), got, ref):
        out[f"{name}_rel"] = float((a - b).norm() / b.norm())
        out[f"{name}_max_abs"] = float((a - b).abs().max())
    del ref, got
    torch.cuda.empty_cache()
    return out


def emit(record: dict, out: Path | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        with open(out / "gpu_tune.jsonl", "a") as fh:
            fh.write(line + "\n")


def run_n(n: int, out: Path | None, only: set[str] | None = None) -> None:
    """Every variant (or those in ``only``) at ``n`` rows."""
    default_row_dot = tile_math.row_dot_
    hidden, weight, labels = inputs(n)
    unit = bench(lambda: torch.mm(hidden, weight.T))
    emit({"n": n, "gemm_unit_ms": unit, "device": torch.cuda.get_device_name()}, out)
    variants = [("default", {}, default_row_dot)]
    if n == 8192:
        variants += [
            ("bmm-rowdot", {}, row_dot_bmm),
            ("vecdot-rowdot", {}, row_dot_vecdot),
            ("ws512", {"workspace_mib": 512}, default_row_dot),
            ("ws2048", {"workspace_mib": 2048}, default_row_dot),
        ]
    for name, opts, row_dot in variants:
        if only is not None and name not in only:
            continue
        tile_math.row_dot_ = row_dot
        backend = TorchBackend(TorchOptions(**opts))

        def fwd(b: TorchBackend = backend) -> object:
            return call(b, hidden, weight, labels, False)

        def fwd_bwd(b: TorchBackend = backend) -> object:
            return call(b, hidden, weight, labels, True)

        tiles = backend.tiles(n, V, torch.bfloat16, torch.device("cuda"))
        rec: dict = {"n": n, "variant": name, "tiles": str(tiles)}
        rec["fwd_units"] = bench(fwd) / unit
        rec["fwd_bwd_units"] = bench(fwd_bwd) / unit
        rec["peak_extra_gib"] = peak_extra_gib(fwd_bwd)
        if name == "default" and n == 8192:
            rec.update(errors(n, hidden, weight, labels, backend))
        emit(rec, out)
    tile_math.row_dot_ = default_row_dot
    if n == 8192 and only is None:
        backend = TorchBackend(TorchOptions())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call(backend, hidden, weight, labels, True)
            torch.cuda.synchronize()
        try:
            table = prof.key_averages().table(sort_by="device_time_total", row_limit=25)
        except Exception:  # older key name
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        print(table, flush=True)
        if out is not None:
            (out / "profile.txt").write_text(table)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--ns", default="8192,32768")
    p.add_argument("--variants", default=None, help="comma-separated variant names to run")
    args = p.parse_args()
    only = None if args.variants is None else set(args.variants.split(","))
    torch.backends.cuda.matmul.allow_tf32 = False
    for n in map(int, args.ns.split(",")):
        run_n(n, args.out, only)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
