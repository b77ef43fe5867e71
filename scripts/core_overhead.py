"""The core's own cost per call over the bare backend: ``fused_head`` against ``backend.forward``.

CPU, a tiny shape, ``check_labels=False``; the minimum over several runs of many calls each, so
the figure is the core's Python work, not noise. Usage: ``python scripts/core_overhead.py
[--backend torch] [--n 8 --hidden 16 --vocab 64] [--json]``.
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


def best_us(fns: list[Callable[[], object]], calls: int, runs: int) -> list[float]:
    """For each function, the minimum over ``runs`` of the mean time of ``calls`` calls (µs).

    The functions take turns run by run, so a slow spell of the machine hits them alike.
    """
    for fn in fns:
        for _ in range(calls // 10 + 1):
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(runs):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls)
    return [b * 1e6 for b in best]


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
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=7)
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
    bare, core = best_us(
        [
            lambda: backend.forward(call),
            lambda: fused_head(hidden, weight, labels, backend=name, check_labels=False),
        ],
        args.calls,
        args.runs,
    )
    result = {
        "backend": args.backend,
        "shape": [args.n, args.hidden, args.vocab],
        "bare_us": round(bare, 1),
        "fused_head_us": round(core, 1),
        "overhead_us": round(core - bare, 1),
        "torch": torch.__version__,
    }
    print(json.dumps(result) if args.json else " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
