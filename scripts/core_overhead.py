"""The core's own cost per call over the bare backend: ``fused_head`` against ``backend.forward``.

CPU, a tiny shape, ``check_labels=False``; the minimum over many short interleaved runs of each,
so the figure is the core's Python work, not noise. Usage: ``python scripts/core_overhead.py
[--backend torch|null] [--n 8 --hidden 16 --vocab 64] [--calls 200 --runs 60] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from fusedhead import fused_head, register_backend
from fusedhead.api import get_fused_head
from fusedhead.protocol import Capabilities, HeadCall, HeadOutput, NoOptions


class NullBackend:
    """Returns outputs made once: what is left of a call through the core is the core's work."""

    name = "overhead-null"
    Options = NoOptions
    plugin_api_version = 2
    out: HeadOutput | None = None

    def __init__(self, options: NoOptions) -> None:
        self.options = options

    def capabilities(self, device: torch.device) -> Capabilities:
        return Capabilities(devices=("cpu",))

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        return None

    def forward(self, call: HeadCall) -> HeadOutput:
        assert self.out is not None
        return self.out


def run_times(fns: list[Callable[[], object]], calls: int, runs: int) -> list[list[float]]:
    """For each function, the mean time of ``calls`` calls (µs) in each of ``runs`` runs.

    The functions take turns run by run, in alternating order (A B, B A, ...), so a slow spell of
    the machine, or the cache state one leaves the other, hits them alike. Short runs, many of them:
    on a shared machine a short run has a fair chance to fall between other people's work.
    """
    for fn in fns:
        for _ in range(max(calls, 200)):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    for _ in range(runs):
        for i in order:
            fn = fns[i]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[i].append((time.perf_counter() - start) / calls * 1e6)
        order.reverse()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        default="torch",
        help="backend to put the core in front of; 'null' measures the core alone against a "
        "backend that returns outputs made once",
    )
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--calls", type=int, default=200, help="calls per run")
    parser.add_argument("--runs", type=int, default=60, help="runs per function, interleaved")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.n, args.hidden, generator=g)
    weight = torch.randn(args.vocab, args.hidden, generator=g)
    labels = torch.randint(0, args.vocab, (args.n,), generator=g)
    name = args.backend
    if name == "null":
        name = NullBackend.name
        register_backend(name, NullBackend)
        NullBackend.out = HeadOutput(torch.zeros(args.n), torch.zeros(args.n))
    backend = get_fused_head(name).backend
    call = HeadCall.make(hidden, weight, labels)
    bare_t, core_t = run_times(
        [
            lambda: backend.forward(call),
            lambda: fused_head(hidden, weight, labels, backend=name, check_labels=False),
        ],
        args.calls,
        args.runs,
    )
    bare, core = min(bare_t), min(core_t)
    half = args.runs // 2
    result = {
        "backend": args.backend,
        "shape": [args.n, args.hidden, args.vocab],
        "bare_us": round(bare, 1),
        "fused_head_us": round(core, 1),
        "overhead_us": round(core - bare, 1),
        # The same figure from each half of the runs alone: apart by more than a few tenths, the
        # machine was busy (run again, or with more runs).
        "halves_us": [
            round(min(core_t[:half]) - min(bare_t[:half]), 1),
            round(min(core_t[half:]) - min(bare_t[half:]), 1),
        ],
        "runs": f"{args.runs}x{args.calls}",
        "torch": torch.__version__,
    }
    print(json.dumps(result) if args.json else " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
