"""Time one source tree's head calls (the tree on ``sys.path``) for an A/B of trees: ``ab.sh``.

Each case is timed after its own GEMM unit (one ``hidden @ weight.T`` of the shape), by
``triton.testing.do_bench`` medians on a GPU; one JSON line per run, tagged, on stdout.

    python scripts/gpu/ab_cases.py TAG [--backend triton] [--cases plain,gather_check,...]
    python scripts/gpu/ab_cases.py TAG --dry   # the CPU, the torch backend, tiny shapes

The policy case also records its weight gradient's error against fp32 (up to N = 8192 at
V = 151936), for trees that change how that gradient is summed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

import fusedhead
from fusedhead import FusedHead, fused_kl, fused_policy_loss
from fusedhead.reference import reference_policy_loss

#: name -> (forward only, check_labels, further call arguments by name: see ``_kwargs``)
CASES: dict[str, tuple[bool, bool, tuple[str, ...]]] = {
    "plain": (True, False, ()),
    "plain_check": (True, True, ()),
    "gather": (True, False, ("gather_ids",)),
    "gather_check": (True, True, ("gather_ids",)),
    "topk32": (True, True, ("top_k",)),
    "fb": (False, False, ()),
    "fb_check": (False, True, ()),
    "gather_fb": (False, True, ("gather_ids",)),
    # fused_kl of two heads of the shape (the teacher: its own hidden states and weight)
    "kl": (True, False, ("teacher",)),
    "kl_fb": (False, False, ("teacher",)),
    # fused_policy_loss, fwd+bwd (policy_loss_bench.py's loss); also its weight gradient's
    # relative L2 error against reference_policy_loss in fp32 on the same values
    "policy": (False, True, ("policy",)),
}
#: Most logits the policy case's fp32 reference is formed for (N = 8192 at V = 151936: about
#: 5 GB a copy, several held by autograd).
REFERENCE_MAX_LOGITS = 8192 * 151936
#: The policy case's loss: issue 31's (clip 0.2 / 0.28, entropy 0.01, k3 KL 0.001, token-mean).
POLICY = {"clip_low": 0.2, "clip_high": 0.28, "entropy_coef": 0.01, "kl_coef": 0.001,
          "kl_estimator": "k3", "aggregation": "token-mean"}  # fmt: skip


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("tag", help="the tree's name in the output")
    args.add_argument("--backend", default="triton")
    args.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated, of " + ", ".join(CASES)
    )
    args.add_argument("--n", type=int, nargs="+", default=[8192], help="token counts, in turn")
    args.add_argument("--hidden", type=int, default=4096)
    args.add_argument("--vocab", type=int, default=151936)
    args.add_argument("--dry", action="store_true", help="CPU, torch backend, tiny shapes")
    opts = args.parse_args()
    if opts.dry:
        opts.backend, opts.n, opts.hidden, opts.vocab = "torch", [64], 32, 500
    names = [c for c in opts.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; known: {list(CASES)}")
    dev = torch.device("cpu" if opts.dry else "cuda")
    dtype = torch.float32 if opts.dry else torch.bfloat16
    for n in opts.n:
        run(opts, names, dev, dtype, n)


def run(opts: argparse.Namespace, names: list[str], dev: torch.device, dtype: torch.dtype,
        n: int) -> None:  # fmt: skip
    """One JSON line: each case at ``n`` tokens, after its own GEMM unit."""
    h, v = opts.hidden, opts.vocab
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(n, h, device=dev, generator=g).to(dtype)
    weight = (torch.randn(v, h, device=dev, generator=g) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), device=dev, generator=g)
    labels[torch.randperm(n, device=dev, generator=g)[: n // 10]] = -100
    extra = {"gather_ids": torch.randint(0, v, (n, 32), device=dev, generator=g), "top_k": 32}
    coef = torch.randn(n, device=dev, generator=g)
    t_hidden = torch.randn(n, h, device=dev, generator=g).to(dtype)
    t_weight = (torch.randn(v, h, device=dev, generator=g) * 2 / h**0.5).to(dtype)
    head = FusedHead(backend=opts.backend, device=str(dev))
    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def kl_case(fwd_only: bool) -> Callable[[], Any]:
        def call(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return fused_kl(hidden, weight, t_hidden, t_weight, labels, backend=opts.backend,
                            temperature=0.7)  # fmt: skip

        def forward() -> Any:
            with torch.no_grad():
                return call(hidden, weight)

        def both() -> None:
            (call(hh, ww) * coef).sum().backward()
            hh.grad = ww.grad = None

        return forward if fwd_only else both

    with torch.no_grad():
        lp0 = head(hidden, weight, labels, temperature=0.7).log_probs
    pol = {"old_log_probs": lp0 + 0.05 * torch.randn(n, device=dev, generator=g),
           "ref_log_probs": lp0 + 0.05 * torch.randn(n, device=dev, generator=g),
           "advantages": coef, "temperature": 0.7, **POLICY}  # fmt: skip

    def policy_step() -> None:
        fused_policy_loss(hh, ww, labels, backend=opts.backend, **pol).loss.backward()
        hh.grad = ww.grad = None

    def policy_grad_w_err() -> float:
        w = weight.clone().requires_grad_()
        fused_policy_loss(hidden, w, labels, backend=opts.backend, **pol).loss.backward()
        w32 = weight.float().requires_grad_()
        reference_policy_loss(hidden.float(), w32, labels, **pol).backward()
        assert w.grad is not None and w32.grad is not None
        return float((w.grad.float() - w32.grad).norm() / w32.grad.norm())

    def case(name: str) -> Callable[[], Any]:
        fwd_only, check, more = CASES[name]
        if "teacher" in more:
            return kl_case(fwd_only)
        if "policy" in more:
            return policy_step
        kw = {k: extra[k] for k in more}

        def forward() -> Any:
            with torch.no_grad():
                return head(hidden, weight, labels, temperature=0.7, check_labels=check, **kw)

        def both() -> None:
            out = head(hh, ww, labels, temperature=0.7, check_labels=check, **kw)
            loss = (out.log_probs * coef).sum() + out.entropy.sum()
            if out.gathered is not None:
                loss = loss + out.gathered.mean(-1).sum()
            loss.backward()
            hh.grad = ww.grad = None

        return forward if fwd_only else both

    def bench(fn: Callable[[], Any], rep_ms: int) -> float:
        if opts.dry:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=200, rep=rep_ms, return_mode="median"))

    res: dict[str, Any] = {"tag": opts.tag, "src": os.path.dirname(fusedhead.__file__),
                           "backend": opts.backend, "shape": [n, h, v]}  # fmt: skip
    for name in names:
        fn = case(name)
        fn()  # compile and warm up
        unit = bench(lambda: hidden @ weight.T, 600)
        ms = bench(fn, 1200 if CASES[name][0] else 2000)
        res[name] = round(ms, 3)
        res[name + "_units"] = round(ms / unit, 4)
        res[name + "_unit_ms"] = round(unit, 3)
        if dev.type == "cuda":  # one more call's peak beyond what was allocated before it
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            res[name + "_peak_gib"] = round((torch.cuda.max_memory_allocated() - before) / 2**30, 4)
        if name == "policy" and n * v <= REFERENCE_MAX_LOGITS:
            res["policy_grad_w_err"] = policy_grad_w_err()
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
