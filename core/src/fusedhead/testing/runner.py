"""``fusedhead check NAME``: run the conformance kit, one line per property, exit 1 if any failed.

Output: ``PASS name``, ``FAIL name: why`` or ``NOT RUN name: why`` per property, then a summary.
Exit status: 0 when no property failed, 1 when one did; a backend that cannot run on the asked
device and dtype is an error (the ``fusedhead`` command exits 2 with the reason).
"""

from __future__ import annotations

import argparse
import json
import sys

DTYPES = ("bf16", "fp16", "fp32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``check`` sub-command's arguments."""
    from fusedhead.cli import device_arg

    parser.add_argument("name", help="backend name (as in `fusedhead list`)")
    parser.add_argument(
        "--device", default="cpu", type=device_arg, help="cpu (default), cuda or cuda:K"
    )
    parser.add_argument(
        "--dtype", default="fp32", choices=DTYPES, help="input dtype (default fp32)"
    )
    parser.add_argument(
        "--options",
        default=None,
        help="backend options as a JSON object, e.g. '{\"chunk_rows\": 256}' (torch's)",
    )
    parser.add_argument(
        "-k",
        dest="pattern",
        default=None,
        help="run only properties whose name contains one of these comma-separated substrings",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="list the properties with a line each (with --json: a JSON list) and exit",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the results as a JSON list instead"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print each property's time")


def run(args: argparse.Namespace) -> int:
    """Run the kit as ``args`` says; 0 when no property failed, 1 otherwise."""
    from fusedhead.cli import runnable_device
    from fusedhead.testing.catalog import describe, run_property, select
    from fusedhead.testing.target import Target

    names = select(args.pattern)
    if args.list:  # with --json: objects keyed as the results' ("property"), else a line each
        if args.json:
            rows = [{"property": name, "description": describe(name)} for name in names]
            print(json.dumps(rows, indent=2))
        else:
            for name in names:
                print(f"{name}: {describe(name)}")
        return 0
    target = Target.resolve(args.name, args.options, runnable_device(args.device), args.dtype)
    if not args.json:
        count = f"{len(names)} propert{'y' if len(names) == 1 else 'ies'}"
        ident = target.head.identity()  # a backend registered in-process has no distribution
        dist = " ".join(str(ident[k]) for k in ("distribution", "version") if ident[k])
        dist = f" ({dist})" if ident["distribution"] else ""
        print(f"fusedhead conformance kit: {target.describe()}{dist}, {count}", flush=True)
    results = []
    for name in names:
        result = run_property(name, target)
        results.append(result)
        if not args.json:
            suffix = f"  ({result.seconds:.1f}s)" if args.verbose else ""
            print(result.line() + suffix, flush=True)
    counts = {o: sum(r.outcome.value == o for r in results) for o in ("pass", "fail", "not run")}
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "property": r.name,
                        "outcome": r.outcome.value,
                        "message": r.message,
                        "seconds": round(r.seconds, 3),
                    }
                    for r in results
                ],
                indent=2,
            )
        )
    else:
        print(
            f"{target.backend} on {target.device} {target.dtype_name}: "
            f"{counts['pass']} pass, {counts['fail']} fail, {counts['not run']} not run"
        )
    sys.stdout.flush()
    return 1 if counts["fail"] else 0
