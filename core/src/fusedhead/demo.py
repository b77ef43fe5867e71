"""``fusedhead demo``: the main job out of the box, checked against the reference.

One backend (default ``torch`` on the CPU) on a realistic problem (N=2048 tokens, H=1024, V=32000,
fp32, temperature 0.7, a tenth of the labels ignored): errors of log-probs, entropy and both
gradients against a float64 reference on the same inputs, judged by fusedhead's accuracy targets
(``TOLERANCES``, widened for an entropy the backend declares in a lower precision); time and peak
extra memory of one forward +
backward next to the full-logits reference's. ``--model NAME`` runs a small causal LM end to end
instead (``fusedhead.integrations.demo_model``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from typing import Any

MODEL_MODULE = "fusedhead.integrations.demo_model"
#: Relative error targets against float64 by input dtype: log-probs, entropy, gradients.
TOLERANCES = {
    "fp32": {"log_probs": 1e-5, "entropy": 1e-5, "grad": 1e-4},
    "fp16": {"log_probs": 3e-4, "entropy": 1e-4, "grad": 5e-3},
    "bf16": {"log_probs": 3e-4, "entropy": 1e-4, "grad": 5e-3},
}


def tolerances(dtype: str, logits_precision: str, entropy_precision: str) -> dict[str, float]:
    """Targets for ``dtype`` inputs; log-probs from logits held in a coarser precision, and an
    entropy held (or computed from logits held) in one, may be off by 2 u of it, as the kit allows
    (``testing.tolerances``: the held precision is never coarser than the inputs)."""
    from fusedhead.testing.tolerances import UNIT_ROUNDOFF, coarser, finer

    tol = dict(TOLERANCES[dtype])
    logits = finer(logits_precision, dtype)
    entropy = coarser(logits, finer(entropy_precision, dtype))
    for output, held in (("log_probs", logits), ("entropy", entropy)):
        tol[output] = max(tol[output], 2 * UNIT_ROUNDOFF[held] if held != "fp32" else 0.0)
    return tol


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fusedhead demo``; every number is checked by its type (naming the flag)."""
    from fusedhead.cli import (
        MAX_REPS,
        device_arg,
        json_object,
        nonnegative_int,
        positive_float,
        positive_int,
        reps_int,
    )

    parser.add_argument("--backend", default="torch", help="backend name (default: torch)")
    parser.add_argument(
        "--options",
        default=None,
        type=json_object,
        metavar="JSON",
        help="the backend's options as a JSON object",
    )
    parser.add_argument(
        "--device", default="cpu", type=device_arg, help="cpu (default), cuda or cuda:K"
    )
    parser.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "fp16", "bf16"],
        help="input dtype (default fp32)",
    )
    parser.add_argument("--n", type=positive_int, default=2048, help="tokens N (default 2048)")
    parser.add_argument(
        "--hidden", type=positive_int, default=1024, help="hidden size H (default 1024)"
    )
    parser.add_argument(
        "--vocab", type=positive_int, default=32000, help="vocabulary size V (default 32000)"
    )
    parser.add_argument(
        "--temperature", type=positive_float, default=0.7, help="temperature (default 0.7)"
    )
    parser.add_argument(
        "--scale", type=positive_float, default=1.0, help="weight scale: 1 flat (default), 4 peaked"
    )
    parser.add_argument(
        "--seed", type=nonnegative_int, default=0, help="generator seed of the inputs"
    )
    parser.add_argument(
        "--reps",
        type=reps_int,
        default=3,
        help=f"timed forward+backward repetitions, 1 to {MAX_REPS} (median; default 3)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak memory measurement")
    parser.add_argument(
        "--quiet", action="store_true", help="no progress lines on stderr (the report only)"
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="run a small random causal LM end to end instead (e.g. tiny-llama, tiny-qwen2; "
        "needs transformers); it takes --backend, --options, --device and --dtype only",
    )


#: The synthetic problem's flags, which ``--model`` (its own model and batch) does not read.
PROBLEM_ONLY = ("n", "hidden", "vocab", "temperature", "scale", "seed", "reps", "no_memory")


def _refuse_problem_flags(args: argparse.Namespace) -> None:
    """``--model`` with a flag it would ignore is refused by name, never run as if it were read."""
    from fusedhead.cli import flags_given

    given = flags_given(args, add_arguments, PROBLEM_ONLY)
    if given:
        one = len(given) == 1
        raise ValueError(
            f"demo --model {args.model}: {', '.join(given)} {'sets' if one else 'set'} the "
            "synthetic problem, which --model does not run (its model fixes the sizes, "
            f"temperatures and batch); drop {'it' if one else 'them'}, or drop --model"
        )


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 on PASS, 1 on FAIL; raises (the command exits 2) when it cannot run."""
    if args.model is not None:  # '' too: the model demo names what it takes
        _refuse_problem_flags(args)
        if getattr(args, "device", None) is not None:
            from fusedhead.cli import runnable_device

            runnable_device(args.device)  # as the synthetic demo checks it (meta: exit 2)
        if importlib.util.find_spec(MODEL_MODULE) is None:
            raise ValueError(f"demo --model: {MODEL_MODULE} is not available in this installation")
        if isinstance(args.options, dict):  # the model demo takes --options as JSON text
            args.options = json.dumps(args.options)
        result: int = importlib.import_module(MODEL_MODULE).run(args)
        return result
    return _run_problem(args)


def _options(raw: str | dict[str, Any] | None) -> dict[str, Any]:
    """The ``--options`` value: parsed by its argument type already, or JSON text (callers)."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, dict):
        return raw
    from fusedhead.cli import json_object

    try:
        return json_object(raw)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"--options {exc}") from None


class _Progress:
    """Progress lines on stderr (``[  1.2 s] what now``), so a long step is never silent."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.start = time.perf_counter()

    def __call__(self, what: str) -> None:
        if not self.quiet:
            elapsed = time.perf_counter() - self.start
            print(f"fusedhead demo: [{elapsed:6.1f} s] {what}", file=sys.stderr, flush=True)


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def _fmt_time(ms: float) -> str:
    """Seconds from 1 s, else ms to three significant digits (a small problem's GEMM unit is
    a few hundredths of a ms, and time / unit must be readable from the columns)."""
    if ms >= 1e3:
        return f"{ms / 1e3:.2f} s"
    return f"{ms:.1f} ms" if ms >= 10 else f"{ms:.3g} ms"


def _run_problem(args: argparse.Namespace) -> int:
    import torch

    from fusedhead.api import FusedHead
    from fusedhead.bench import accuracy, peers, provenance, timing
    from fusedhead.bench.cases import (
        IGNORE_INDEX,
        Case,
        make_inputs,
        refuse_overflow,
        refuse_unfit,
    )
    from fusedhead.bench.measure import measure
    from fusedhead.cli import runnable_device
    from fusedhead.errors import BackendUnavailableError

    progress = _Progress(getattr(args, "quiet", False))
    options = _options(args.options)
    device = runnable_device(args.device)
    if device.type == "cuda":
        timing.disable_tf32()
    progress(f"resolving backend {args.backend!r}")
    # keyword arguments: a bad name is named as --backend's value, not a FusedHeadConfig's field
    head = FusedHead(backend=args.backend, options=options, device=str(device))
    caps = head.capabilities(device)
    case = Case(
        args.n,
        args.hidden,
        args.vocab,
        args.dtype,
        args.temperature,
        args.scale,
        args.seed,
        str(device),
    )
    refuse_unfit([case], device)
    refuse_overflow([case])
    spec = args.backend if not options else f"{args.backend}:{json.dumps(options)}"
    backend_impl = peers.resolve(spec)
    reason = backend_impl.availability(case)
    if reason:
        raise BackendUnavailableError(
            f"cannot run this problem here: {reason}",
            backend=args.backend,
            distribution=head.distribution,
            version=head.version,
        )
    reference_impl = peers.resolve("reference")

    dev = provenance.device_info(device)
    where = dev["name"] + (f", {dev['cores']} cores" if dev["type"] == "cpu" else "")
    print(
        f"fusedhead demo: backend {args.backend!r} ({head.distribution or 'in-process'} "
        f"{head.version or ''}".rstrip()
        + f") on {device} ({where})"
    )
    progress(f"drawing the inputs (N={case.n}, H={case.hidden}, V={case.vocab}, {case.dtype})")
    inputs = make_inputs(case)
    ignored = int((inputs.labels == IGNORE_INDEX).sum())
    print(
        f"problem: N={case.n} tokens, H={case.hidden}, V={case.vocab}, {case.dtype}, "
        f"temperature {case.temperature:g}, {ignored} of {case.n} labels ignored ({IGNORE_INDEX})"
    )

    progress("the float64 reference: log-probs, entropy and both gradients (the slow part)")
    ref = accuracy.compute_reference(case, inputs, dtype=torch.float64)
    progress("timing one GEMM unit (hidden @ weight.T)")
    unit_ms = timing.gemm_ms(inputs.hidden, inputs.weight, reps=1)
    common = {
        "unit_ms": unit_ms,
        "reps": args.reps,
        "measure_memory": not args.no_memory,
        "forward": False,
        "interleave_gemm": True,  # on the CPU each repetition is paired with a GEMM
    }
    progress(f"backend {args.backend!r}: {args.reps} timed forward + backward, errors, memory")
    got = measure(case, backend_impl, inputs, ref, **common)
    ref_reason = reference_impl.availability(case)
    if not ref_reason:
        progress(f"full-logits reference: {args.reps} timed forward + backward, memory")
    base = None if ref_reason else measure(case, reference_impl, inputs, ref, **common)
    progress("done")

    tol = tolerances(case.dtype, caps.logits_precision, caps.entropy_precision)
    rows = [
        ("log-probs", "log_probs", tol["log_probs"]),
        ("entropy", "entropy", tol["entropy"]),
        ("grad hidden", "grad_hidden", tol["grad"]),
        ("grad weight", "grad_weight", tol["grad"]),
    ]
    print()
    print(
        f"errors against a float64 reference on the same inputs (relative L2 and max abs; "
        f"entropy declared in {caps.entropy_precision})"
    )
    print(f"  {'':12} {'relative':>9} {'target':>9} {'max abs':>9}   {'full-logits rel':>15}")
    failed = []
    for label, key, bound in rows:
        err = got["errors"][key]
        ok = err["rel"] <= bound  # NaN compares False
        if not ok:
            failed.append(label)
        base_rel = "-" if base is None else f"{base['errors'][key]['rel']:.1e}"
        print(
            f"  {label:12} {err['rel']:9.1e} {bound:9.0e} {err['max_abs']:9.1e}   "
            f"{base_rel:>15}{'' if ok else '   <- over the target'}"
        )

    print()
    print(f"one forward + backward (median of {args.reps}; a GEMM unit is one hidden @ weight.T)")
    print(f"  {'':24} {'time':>10} {'GEMM units':>11} {'unit':>9} {'peak extra memory':>18}")
    for label, res in ((f"{args.backend} backend", got), ("full-logits reference", base)):
        if res is None:
            print(f"  {label:24} skipped: {ref_reason}")
            continue
        print(
            f"  {label:24} {_fmt_time(res['fwd_bwd_ms']):>10} {res['fwd_bwd_units']:11.2f} "
            f"{_fmt_time(res['unit_ms']):>9} {_fmt_bytes(res.get('peak_extra_bytes')):>18}"
        )
    summary = ""
    if base is not None:
        ratio = got["fwd_bwd_units"] / base["fwd_bwd_units"]
        summary = f"; {ratio:.2f}x the reference's time (in GEMM units)"
        mb, rb = got.get("peak_extra_bytes"), base.get("peak_extra_bytes")
        if mb is not None and rb:
            summary += f", {100 * mb / rb:.1f}% of its peak extra memory"
    print()
    if failed:
        print(
            f"FAIL: backend {args.backend!r} misses the accuracy target on {', '.join(failed)}{summary}"
        )
        return 1
    print(
        f"PASS: backend {args.backend!r} matches the float64 reference within the {case.dtype} targets{summary}"
    )
    return 0
