"""Issue 31: the policy loss inside the head, against the four-GEMM paths, on one GPU.

    python scripts/gpu/policy_loss_bench.py OUT_DIR                      # bf16, H=4096, V=151936
    python scripts/gpu/policy_loss_bench.py OUT_DIR --device cpu --small  # a smoke run

One PPO/GRPO step of the LM head, forward + backward, in one process (bf16, T = 0.7; clip 0.2 /
0.28, entropy 0.01, k3 KL 0.001, token-mean; a tenth of the labels ignored):

- ``fused:<backend>[:k=v,...]``: ``fused_policy_loss`` (the gradients computed in the forward);
- ``unfused:<backend>``: ``fused_head`` log-probs and entropy, then the same loss in torch
  (``loss_from_log_probs``), backward through both (four GEMMs);
- ``liger+loss``: liger-kernel's SM90 kernel (``LigerFusedLinearScaledCrossEntropyFunction``,
  log-probs and entropy) and the same loss, where liger-kernel and its CuTe DSL are installed.

Time: median of CUDA-event times over repeats, in ms and in GEMM units (one bf16
``hidden @ weight.T`` cuBLAS GEMM of the same shape, timed in the same process). Peak extra memory:
``max_memory_allocated`` above what is allocated before the step, the gradients of hidden and
weight allocated beforehand. Accuracy (``--accuracy-n`` rows): the loss and both gradients against
``reference_policy_loss`` in fp32 on the same bf16 values (full logits), and determinism (two runs,
bitwise). Writes ``OUT_DIR/policy_loss_bench.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

LOSS = {
    "temperature": 0.7,
    "clip_low": 0.2,
    "clip_high": 0.28,
    "entropy_coef": 0.01,
    "kl_coef": 0.001,
    "kl_estimator": "k3",
    "aggregation": "token-mean",
}


def loss_from_log_probs(
    lp: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor, old: torch.Tensor,
    adv: torch.Tensor, ref: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """verl's vanilla PPO loss (token-mean) with the entropy bonus and the k3 KL, in torch."""
    m = mask.float()
    count = m.sum()
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - LOSS["clip_low"], 1 + LOSS["clip_high"])
    pg = torch.maximum(pg1, pg2)
    d = torch.clamp(ref - lp, -20, 20)
    kl = torch.clamp(torch.exp(d) - d - 1, -10, 10)
    per_token = pg - LOSS["entropy_coef"] * ent + LOSS["kl_coef"] * kl
    return (torch.where(mask, per_token, 0.0) * m).sum() / count


def make_inputs(n: int, h: int, v: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(n, h, generator=g) * 1.0).to(device, dtype)
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h) * 2.0).to(device, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    labels[torch.rand(n, generator=g).to(device) < 0.1] = -100
    import fusedhead

    with torch.no_grad():
        lp = fusedhead.fused_head(
            hidden, weight, labels, backend="torch", temperature=0.7
        ).log_probs
    noise = torch.randn(n, generator=g).to(device)
    return {
        "hidden": hidden,
        "weight": weight,
        "labels": labels,
        "old_log_probs": lp + 0.1 * noise,
        "ref_log_probs": lp + 0.1 * torch.randn(n, generator=g).to(device),
        "advantages": torch.randn(n // 16 + 1, generator=g).to(device).repeat_interleave(16)[:n],
    }


def build(spec: str, x: dict[str, Any]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The step of ``spec``: (hidden, weight) leaves -> the loss."""
    import fusedhead

    kind, _, rest = spec.partition(":")
    name, _, opts = rest.partition(":")
    options = dict(kv.split("=") for kv in opts.split(",")) if opts else {}
    options = {k: (int(val) if val.isdigit() else val) for k, val in options.items()}
    labels, old, adv, ref = x["labels"], x["old_log_probs"], x["advantages"], x["ref_log_probs"]
    mask = labels != -100
    if kind == "fused":

        def fused(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            out = fusedhead.fused_policy_loss(
                h, w, labels, old_log_probs=old, advantages=adv, ref_log_probs=ref,
                backend=name, options=options or None, **LOSS,
            )  # fmt: skip
            return out.loss

        return fused
    if kind == "unfused":

        def unfused(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            lp, ent = fusedhead.fused_head(
                h, w, labels, backend=name, temperature=LOSS["temperature"], options=options or None
            )
            return loss_from_log_probs(lp, ent, mask, old, adv, ref)

        return unfused
    if kind == "liger+loss":
        from liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90 import (  # noqa: F401
            LigerFusedLinearScaledCrossEntropyFunction as _probe,
        )
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
            LigerFusedLinearScaledCrossEntropyFunction as function,
        )

        def liger(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            nll, ent = function.apply(h, w, labels, LOSS["temperature"], -100, 1, True)
            return loss_from_log_probs(-nll.float(), ent.float(), mask, old, adv, ref)

        return liger
    raise SystemExit(f"unknown implementation {spec!r}")


def warm_step(
    spec: str, n: int, runs: int = 3
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor]:
    """``spec``'s step at N = ``n`` on this CUDA GPU (the bench's case), with its leaves, their
    gradients allocated beforehand, after ``runs`` warm-up steps: (step, hidden, weight)."""
    x = make_inputs(n, 4096, 151936, torch.device("cuda"), torch.bfloat16)
    fn = build(spec, x)
    h = x["hidden"].detach().clone().requires_grad_()
    w = x["weight"].detach().clone().requires_grad_()
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    for _ in range(runs):
        fn(h, w).backward()
    torch.cuda.synchronize()
    return fn, h, w


def timed(fn: Callable[[], Any], reps: int, device: torch.device) -> list[float]:
    """Per-run milliseconds (CUDA events; wall clock on the CPU), after two warm-up runs."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(device)
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    a, b = a.double(), b.double()
    return {
        "max_rel": ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item(),
        "norm_rel": ((a - b).norm() / b.norm().clamp(min=1e-30)).item(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="N 256, H 64, V 1000, fp32 (a smoke run)")
    p.add_argument("--n", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--accuracy-n", type=int, default=8192)
    p.add_argument("--impl", nargs="+", default=[
        "fused:triton", "fused:triton:memory=fast", "unfused:triton", "fused:torch",
        "unfused:torch", "liger+loss",
    ])  # fmt: skip
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.float32 if a.small else torch.bfloat16
    h_size, v_size = (64, 1000) if a.small else (4096, 151936)
    ns = [256] if a.small else a.n
    a.out.mkdir(parents=True, exist_ok=True)
    import fusedhead

    records: list[dict[str, Any]] = []
    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "fusedhead": fusedhead.__version__,
        "loss": LOSS,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    for n in ns:
        x = make_inputs(n, h_size, v_size, device, dtype)
        hid, wt = x["hidden"], x["weight"]
        unit = statistics.median(timed(lambda a=hid, b=wt: a @ b.T, a.reps, device))
        h = hid.detach().clone().requires_grad_()
        w = wt.detach().clone().requires_grad_()
        h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
        for spec in a.impl:
            rec: dict[str, Any] = {"n": n, "impl": spec, "gemm_unit_ms": unit}
            try:
                fn = build(spec, x)

                def step(fn: Any = fn, h: torch.Tensor = h, w: torch.Tensor = w) -> None:
                    fn(h, w).backward()

                ms = timed(step, a.reps, device)
                rec["fwd_bwd_ms"] = statistics.median(ms)
                rec["fwd_bwd_units"] = rec["fwd_bwd_ms"] / unit
                rec["ms_all"] = ms
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    before = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    step()
                    torch.cuda.synchronize(device)
                    rec["peak_extra_gib"] = (
                        torch.cuda.max_memory_allocated(device) - before
                    ) / 2**30
            except Exception as exc:  # recorded, the run goes on
                rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
            records.append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "ms_all"}), flush=True)
        del x, h, w
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # Accuracy and determinism on --accuracy-n rows against fp32 on the same bf16 values.
    n = min(a.accuracy_n, ns[0])
    x = make_inputs(n, h_size, v_size, device, dtype)
    from fusedhead.reference import reference_policy_loss

    h32 = x["hidden"].float().requires_grad_()
    w32 = x["weight"].float().requires_grad_()
    args = {k: x[k] for k in ("labels", "old_log_probs", "advantages", "ref_log_probs")}
    ref = reference_policy_loss(h32, w32, **args, **LOSS, compute_dtype=torch.float32)
    ref.backward()
    ref_loss = ref.detach()
    ref_gh, ref_gw = h32.grad, w32.grad
    del h32, w32, ref
    acc: list[dict[str, Any]] = []
    for spec in a.impl:
        rec = {"n": n, "impl": spec}
        try:
            fn = build(spec, x)
            runs = []
            for _ in range(2):
                h = x["hidden"].detach().clone().requires_grad_()
                w = x["weight"].detach().clone().requires_grad_()
                loss = fn(h, w)
                loss.backward()
                runs.append((loss.detach().float(), h.grad, w.grad))
            (l1, gh1, gw1), (l2, gh2, gw2) = runs
            rec["loss"] = l1.item()
            rec["loss_ref_fp32"] = ref_loss.item()
            rec["loss_abs_err"] = abs(l1.item() - ref_loss.item())
            rec["grad_hidden"] = rel(gh1, ref_gh)
            rec["grad_weight"] = rel(gw1, ref_gw)
            rec["deterministic"] = bool(
                torch.equal(l1, l2) and torch.equal(gh1, gh2) and torch.equal(gw1, gw2)
            )
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
        acc.append(rec)
        print(json.dumps(rec), flush=True)
    (a.out / "policy_loss_bench.json").write_text(
        json.dumps({"env": env, "timing": records, "accuracy": acc}, indent=1)
    )
    print(f"{'N':>6} {'impl':<28} {'ms':>8} {'units':>6} {'peak GiB':>8}")
    for r in records:
        if "error" in r:
            print(f"{r['n']:>6} {r['impl']:<28} {r['error'][:60]}")
        else:
            print(
                f"{r['n']:>6} {r['impl']:<28} {r['fwd_bwd_ms']:8.2f} {r['fwd_bwd_units']:6.2f} "
                f"{r.get('peak_extra_gib', float('nan')):8.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
