"""Issue 33 (part B) on one GPU: NaN/inf in ignored rows reach nothing, double backward refused.

For every output of ``triton`` (bf16, fp16, fp32), ``torch`` (bf16) and, where it runs,
``liger`` (native bf16 and its fallback), with NaN, +inf and -inf hidden rows whose label is
ignore_index: the outputs there are exactly 0, ``weight.grad`` is finite, the rows' hidden
gradient is exactly 0, and every gradient equals that of the same call with those rows zeroed.
Then a second-order gradient, asked for four ways, must raise an error naming ``create_graph``.
Writes ``OUT/ignored_rows.json`` (one record per case) and prints a summary; exit 1 on a failure.

Usage: ``python scripts/gpu/ignored_rows_check.py OUT`` (about a minute on an H200).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from fusedhead import fused_head, fused_kl

N, H, V = 300, 256, 4096
#: cuda; DEVICE=cpu runs the torch and liger-fallback cases for a smoke test off the GPU.
DEVICE = os.environ.get("DEVICE", "cuda")
BAD = {5: "nan", 17: "inf", 40: "-inf", 99: "one-nan"}
OUTPUTS: dict[str, dict[str, Any]] = {
    "log_probs": {},
    "lse": {"return_lse": True},
    "sum_p2": {"return_sum_p2": True},
    "argmax": {"return_argmax": True},
    "topk": {"top_k": 8},
    "gather": {"gather_ids": None},
    "kl": {},
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def inputs(dtype: torch.dtype, poison: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < 0.1] = -100
    for row, what in BAD.items():
        labels[row] = -100
        if not poison:
            hidden[row] = 0.0
        elif what == "one-nan":
            hidden[row, 3] = float("nan")
        else:
            hidden[row] = float(what)
    return hidden.to(DEVICE, dtype), weight.to(DEVICE, dtype), labels.to(DEVICE)


def run(backend: str, options: Any, dtype: torch.dtype, output: str, poison: bool):
    hidden, weight, labels = inputs(dtype, poison)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    if output == "kl":
        th, tw, _ = inputs(dtype, poison, seed=1)
        ts = [fused_kl(h, w, th, tw, labels, backend=backend, options=options)]
        ids: list[torch.Tensor] = []
    else:
        kw = dict(OUTPUTS[output])
        if output == "gather":
            kw["gather_ids"] = (torch.arange(4 * N, device=DEVICE).reshape(N, 4) * 7) % V
        out = fused_head(h, w, labels, backend=backend, options=options, **kw)
        fields = ("log_probs", "entropy", "lse", "sum_p2", "topk_log_probs", "gathered")
        ts = [getattr(out, f) for f in fields if getattr(out, f) is not None]
        ids = [t for t in (out.argmax, out.topk_ids) if t is not None]
    sum(((i + 1) * t.float()).sum() for i, t in enumerate(ts)).backward()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return ts, ids, h.grad, w.grad


def check_leaks(backend: str, options: Any, dtype_name: str, output: str) -> dict[str, Any]:
    dtype = DTYPES[dtype_name]
    rec: dict[str, Any] = {"check": "ignored_rows", "backend": backend, "options": options,
                           "dtype": dtype_name, "output": output}  # fmt: skip
    try:
        ts, ids, gh, gw = run(backend, options, dtype, output, True)
        cts, _, cgh, cgw = run(backend, options, dtype, output, False)
        bad = list(BAD)
        rec["outputs_zero"] = all(bool((t[bad] == 0).all()) for t in ts)
        rec["ids_minus_one"] = all(bool((t[bad] == -1).all()) for t in ids)
        rec["outputs_equal_clean"] = all(torch.equal(a, b) for a, b in zip(ts, cts, strict=True))
        rec["weight_grad_finite"] = bool(torch.isfinite(gw).all())
        rec["hidden_grad_rows_zero"] = bool((gh[bad] == 0).all())
        rec["grads_equal_clean"] = torch.equal(gw, cgw) and torch.equal(gh, cgh)
        rec["ok"] = all(rec[k] for k in ("outputs_zero", "ids_minus_one", "outputs_equal_clean",
                                         "weight_grad_finite", "hidden_grad_rows_zero"))  # fmt: skip
    except Exception as exc:  # recorded, the run goes on
        rec["ok"] = False
        rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rec["trace"] = traceback.format_exc()[-1500:]
    return rec


def check_double_backward(backend: str, options: Any, output: str, way: str) -> dict[str, Any]:
    rec: dict[str, Any] = {"check": "double_backward", "backend": backend, "options": options,
                           "output": output, "way": way}  # fmt: skip
    hidden, weight, labels = inputs(torch.bfloat16, False)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    try:
        if output == "kl":
            th, tw, _ = inputs(torch.bfloat16, False, seed=1)
            t = fused_kl(h, w, th, tw, labels, backend=backend, options=options)
        else:
            out = fused_head(h, w, labels, backend=backend, options=options, **OUTPUTS[output])
            t = out.lse if output == "lse" else out.log_probs
        t = t.float()
        if way == "grad-hidden-twice":
            (g,) = torch.autograd.grad(t.pow(2).sum(), [h], create_graph=True)
            torch.autograd.grad(g.float().pow(2).sum(), [h])
        elif way == "grad-weight-twice":
            (g,) = torch.autograd.grad(t.sum(), [w], create_graph=True)
            torch.autograd.grad(g.float().pow(2).sum(), [w])
        elif way == "grad-of-total-with-penalty":
            (g,) = torch.autograd.grad(t.pow(2).sum(), [h], create_graph=True)
            torch.autograd.grad(t.sum() + g.float().pow(2).sum(), [h])
        else:
            (g,) = torch.autograd.grad(t.pow(2).sum(), [h], create_graph=True)
            (t.sum() + g.float().pow(2).sum()).backward()
        rec["ok"], rec["error"] = False, "no error: a second-order gradient came back silently"
    except RuntimeError as exc:
        rec["ok"] = "create_graph" in str(exc)
        rec["error"] = str(exc)[:300]
    except Exception as exc:
        rec["ok"], rec["error"] = False, f"{type(exc).__name__}: {exc}"[:300]
    return rec


def liger_cases() -> list[tuple[str, Any, tuple[str, ...]]]:
    """(backend, options, dtypes) of liger where it is installed: native bf16, fallback."""
    try:
        import fusedhead_liger  # noqa: F401
    except ImportError:
        return []
    return [("liger", None, ("bf16",)), ("liger", {"implementation": "fallback"}, ("bf16",))]


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".gpu-out")
    out_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    cases = [
        ("triton", None, ("bf16", "fp16", "fp32"), list(OUTPUTS)),
        ("triton", {"memory": "fast"}, ("bf16",), ["log_probs", "kl"]),
        ("torch", None, ("bf16",), list(OUTPUTS)),
    ] + [(b, o, d, ["log_probs"]) for b, o, d in liger_cases()]
    if DEVICE != "cuda":
        cases = [c for c in cases if c[0] == "torch" or (c[1] is not None and c[0] == "liger")]
    for backend, options, dtypes, outputs in cases:
        for dt in dtypes:
            for output in outputs:
                records.append(check_leaks(backend, options, dt, output))
        for output in ("log_probs", "lse", "kl") if backend != "liger" else ("log_probs",):
            for way in ("grad-hidden-twice", "grad-weight-twice", "grad-of-total-with-penalty",
                        "backward"):  # fmt: skip
                records.append(check_double_backward(backend, options, output, way))
    (out_dir / "ignored_rows.json").write_text(json.dumps(records, indent=1))
    failed = [r for r in records if not r["ok"]]
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    print(f"{len(records) - len(failed)} of {len(records)} checks ok; {where}")
    for r in failed:
        print("FAIL", {k: v for k, v in r.items() if k != "trace"})
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
