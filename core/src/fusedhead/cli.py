"""The ``fusedhead`` command: list, info, check, bench, demo.

``list`` without ``--check`` reads metadata only: it imports neither torch nor any backend.
Sub-commands with heavy imports live in their own modules, loaded only when chosen.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from fusedhead import registry
from fusedhead.errors import BackendError, IncompatibleBackendError

#: Sub-commands implemented elsewhere: module with ``add_arguments(parser)`` and ``run(args) -> int``.
_DELEGATED = {
    "check": ("fusedhead.testing.runner", "run the conformance kit against a backend"),
    "bench": ("fusedhead.bench.cli", "time backends and peers in GEMM units, memory and accuracy"),
    "demo": (
        "fusedhead.demo",
        "the main job: a realistic problem on one backend, checked against the reference",
    ),
}


def _cmd_list(args: argparse.Namespace) -> int:
    rows = registry.listing(probe=args.check, device=args.device)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        table = [("NAME", "DISTRIBUTION", "VERSION", "STATUS", "REASON")]
        for r in rows:
            table.append(
                (
                    r.name,
                    r.distribution or "(in-process)",
                    r.version or "-",
                    r.status.value,
                    r.reason or "",
                )
            )
        widths = [max(len(row[i]) for row in table) for i in range(4)]
        for row in table:
            cells = [c.ljust(w) for c, w in zip(row[:4], widths)]
            print("  ".join([*cells, row[4]]).rstrip())
        if len(table) == 1:
            print("(no backends installed: pip install 'fusedhead[torch]' for the portable one)")
    bad = {registry.Status.BROKEN, registry.Status.INCOMPATIBLE, registry.Status.CONFLICT}
    return 1 if args.check and any(r.status in bad for r in rows) else 0


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    cand = registry.find(args.name)
    out: dict[str, Any] = {
        "name": cand.name,
        "distribution": cand.distribution,
        "version": cand.version,
        "entry_point": cand.value,
    }
    try:
        cls = registry.load_class(args.name)
    except BackendError as exc:
        out["status"] = "incompatible" if isinstance(exc, IncompatibleBackendError) else "broken"
        out["reason"] = str(exc)
        _print_info(out, args.json)
        return 1
    device = torch.device(args.device) if args.device else registry.default_device()
    backend = cls(cls.Options())
    out["plugin_api_version"] = cls.plugin_api_version
    out["device"] = str(device)
    out["capabilities"] = backend.capabilities(device).model_dump(mode="json")
    out["options_schema"] = _options_schema(cls.Options)
    status, reason = registry._probe(cand, device)
    out["status"] = status.value
    if reason:
        out["reason"] = reason
    describe = getattr(backend, "describe", None)
    if callable(describe):
        out["implementation"] = describe(device)
    _print_info(out, args.json)
    return 0


def _options_schema(model: Any) -> list[dict[str, Any]]:
    rows = []
    for name, field in model.model_fields.items():
        rows.append(
            {
                "name": name,
                "type": getattr(field.annotation, "__name__", str(field.annotation)),
                "default": None
                if field.is_required()
                else field.get_default(call_default_factory=True),
                "description": field.description or "",
            }
        )
    return rows


def _print_info(info: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return
    for key, value in info.items():
        if key == "options_schema":
            print("options:")
            if not value:
                print("  (none)")
            for row in value:
                desc = f"  {row['description']}" if row["description"] else ""
                print(f"  {row['name']}: {row['type']} = {row['default']!r}{desc}")
        elif isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v}")
        else:
            print(f"{key}: {value}")


def build_parser(*, delegated: bool = True) -> argparse.ArgumentParser:
    """The argument parser; ``delegated=False`` skips importing the heavy sub-command modules."""
    parser = argparse.ArgumentParser(
        prog="fusedhead", description="fusedhead backends: list, inspect, check, bench, demo"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "list", help="installed backends and their status (metadata only unless --check)"
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of objects")
    p.add_argument(
        "--check",
        action="store_true",
        help="import and probe each backend; exit 1 if any is broken",
    )
    p.add_argument(
        "--device", default=None, help="device for --check (default: cuda if present, else cpu)"
    )
    p.set_defaults(func=_cmd_list)
    p = sub.add_parser(
        "info", help="capabilities, options schema, distribution and status of one backend"
    )
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--device", default=None, help="device to describe (default: cuda if present, else cpu)"
    )
    p.set_defaults(func=_cmd_info)
    for name, (module, help_text) in _DELEGATED.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(module=module)
        if delegated:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(delegated=command in _DELEGATED).parse_args(argv)
    try:
        if hasattr(args, "module"):
            result: int = importlib.import_module(args.module).run(args)
        else:
            result = args.func(args)
    except (BackendError, ValueError, TypeError) as exc:
        print(f"fusedhead: error: {exc}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    raise SystemExit(main())
