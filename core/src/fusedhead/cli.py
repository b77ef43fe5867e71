"""The ``fusedhead`` command: list, info, check, bench, demo (also ``python -m fusedhead``).

``list`` without ``--check`` and ``--version`` read metadata only: they import neither torch nor
any backend. Sub-commands with heavy imports live in their own modules, loaded only when chosen.
Every failure is one line on stderr (``fusedhead: error: ...``) and a non-zero exit: 2 for bad
input or a usage error (a backend that cannot be selected included), 1 for an unexpected failure;
never a traceback, unless ``FUSEDHEAD_TRACEBACK=1`` asks for one, printed before that same line
with the same exit status. With ``--json`` the error's fields (``BackendError.to_dict()``) are
printed on stdout as well.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.metadata as md
import json
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

from fusedhead import diagnostics, install_hints, registry
from fusedhead.env_flags import env_flag
from fusedhead.errors import BackendError
from fusedhead.options import load_json

#: Sub-commands implemented elsewhere: module with ``add_arguments(parser)`` and ``run(args) -> int``.
_DELEGATED = {
    "check": ("fusedhead.testing.runner", "run the conformance kit against a backend"),
    "bench": ("fusedhead.bench.cli", "time backends and peers in GEMM units, memory and accuracy"),
    "demo": (
        "fusedhead.demo",
        "the main job: a realistic problem on one backend, checked against the reference",
    ),
}
#: Set to 1 (or true, yes, on) to get the traceback of a failure before its one line.
TRACEBACK_ENV = "FUSEDHEAD_TRACEBACK"
#: Exit status of a command that could not run (bad input, a backend that cannot be selected).
EXIT_ERROR = 2
#: Exit status when stdout's reader closed the pipe: a shell's for a process killed by SIGPIPE.
EXIT_BROKEN_PIPE = 141


# --- argument types: each names what it takes; argparse adds the flag ---------------------------


#: The largest integer a flag takes: sizes and seeds reach torch as int64.
_INT_FLAG_MAX = 2**63 - 1


def _int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        words = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}")
        if value > _INT_FLAG_MAX:
            raise argparse.ArgumentTypeError(
                f"must be {words} that fits in int64 (at most 2**63 - 1), got {text!r}"
            )
        return value

    parse.__name__ = f"int_at_least_{low}" if high is None else f"int_from_{low}_to_{high}"
    return parse


#: A size or a count: an integer >= 1.
positive_int = _int_at_least(1)
#: A seed or an index: an integer >= 0.
nonnegative_int = _int_at_least(0)
#: Most timed repetitions a measurement takes: ``--max-minutes`` is read between measurements,
#: so a measurement of more would run on past it.
MAX_REPS = 1000
#: Timed repetitions: 1 to ``MAX_REPS``.
reps_int = _int_at_least(1, MAX_REPS)


def _float_in(text: str, low: float, high: float, words: str) -> float:
    """``text`` as a finite float in ``[low, high]``, or an argparse error saying ``words``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}") from None
    if not (math.isfinite(value) and low <= value <= high):
        raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}")
    return value


#: ``fusedhead.protocol.SCALAR_RANGE``, the library's range of a call's float scalars; not
#: imported, as ``list`` and ``--version`` load no pydantic.
_SCALAR_LO, _SCALAR_HI = 2.0**-126, 2.0**126


def positive_float(text: str) -> float:
    """A temperature or a scale, in the library's scalar range: a value the library would refuse
    once the inputs are made is refused here instead, naming the flag."""
    words = "a finite number > 0 in [2**-126, 2**126] (about 1.2e-38 to 8.5e37)"
    return _float_in(text, _SCALAR_LO, _SCALAR_HI, words)


def positive_number(text: str) -> float:
    """A time limit: a finite number > 0 (0 would skip every measurement)."""
    return _float_in(text, math.ulp(0.0), math.inf, "a finite number > 0")


def flags_given(
    args: argparse.Namespace,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    dests: Iterable[str],
) -> list[str]:
    """The ``--flags`` among ``dests`` whose values differ from ``add_arguments``'s defaults:
    those a user set (one given at its default value is not told apart), for a mode that would
    ignore them to refuse by name."""
    probe = argparse.ArgumentParser()
    add_arguments(probe)
    defaults = probe.parse_args([])
    return [
        "--" + dest.replace("_", "-")
        for dest in dests
        if getattr(args, dest, None) != getattr(defaults, dest)
    ]


def json_type(value: object) -> str:
    """JSON's name for a parsed JSON value's type (``null``, not Python's ``NoneType``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    names = {dict: "object", list: "array", str: "string"}
    return next((n for t, n in names.items() if isinstance(value, t)), type(value).__name__)


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line (a backend's options)."""
    try:
        value = load_json(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"must be a JSON object such as '{{\"name\": 1}}', got {text!r}: "
            f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from None
    except ValueError as exc:  # a repeated key
        raise argparse.ArgumentTypeError(f"{exc}, got {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object such as '{{\"name\": 1}}', got a JSON {json_type(value)}: {text!r}"
        )
    return value


def device_arg(text: str) -> str:
    """A torch device string (``cpu``, ``cuda``, ``cuda:1``); availability is checked where used."""
    import torch

    try:
        torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {text!r}"
        ) from None
    return text


def runnable_device(text: str, flag: str = "--device") -> Any:
    """The ``torch.device`` for ``text`` if this process can run on it (cpu, or a CUDA that exists)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(
            f"{flag} must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {text!r}"
        ) from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"{flag} must be cpu, cuda or cuda:K, got {text!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"{flag} {text}: CUDA is not available here (torch sees no CUDA device)")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"{flag} {text}: this machine has {count} CUDA device(s), 0..{count - 1}")
    return device


def property_patterns(text: str) -> str:
    """``check -k``: the kit's own selection rule (``fusedhead.testing.catalog.select``) applied
    while the arguments are parsed, so a typo is a usage error before anything runs."""
    from fusedhead.testing.catalog import select

    try:
        select(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("-k ")) from None
    return text


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to ``word``, case aside, or ``''``."""
    by_lower = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


class _UsageError(SystemExit):
    """An argument the parser refused (exit 2); ``message`` is its line without the prefix, for
    ``--json``."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_ERROR)
        self.message = message


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``fusedhead: error: ...``."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.split(" ", 1)[1] if " " in self.prog else ""
        where = f"{command}: " if command else ""
        line = f"{where}{message} (see {self.prog} --help)"
        print(f"fusedhead: error: {line}", file=sys.stderr)
        raise _UsageError(line)


# --- --version --------------------------------------------------------------------------------


def installed_backends() -> list[tuple[str, str, str]]:
    """(backend name, distribution, version) of every installed entry point, from metadata only.

    Ignores ``FUSEDHEAD_BACKENDS``: this is what is installed, not what discovery shows.
    """
    return sorted(
        (c.name, c.distribution or "unknown", c.version or "")
        for c in registry.installed_entry_points()
    )


def version_text() -> str:
    """The core's version and every installed backend distribution's, read from metadata."""
    try:
        core = md.version("fusedhead")
    except md.PackageNotFoundError:
        from fusedhead import __version__

        core = f"{__version__} (not installed as a distribution)"
    lines = [f"fusedhead {core}"]
    dists: dict[str, tuple[str, list[str]]] = {}
    for name, dist, version in installed_backends():
        dists.setdefault(dist, (version, []))[1].append(name)
    for dist, (version, names) in sorted(dists.items()):
        lines.append(f"{dist} {version} (backend {', '.join(names)})")
    if not dists:
        lines.append(
            f"(no backend distributions installed; the portable one: {install_hints.install_command('torch')})"
        )
    lines.append(f"python {sys.version.split()[0]}")
    return "\n".join(lines)


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help=kwargs.get("help"))

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(version_text())
        parser.exit(0)


# --- list -------------------------------------------------------------------------------------


def _limit_note(shown: set[str]) -> str | None:
    """What ``FUSEDHEAD_BACKENDS`` hides and which of its names nothing installs, or None."""
    raw = os.environ.get(registry.LIMIT_ENV)
    if raw is None or not raw.strip():
        return None
    allowed = {p.strip() for p in raw.split(",") if p.strip()}
    installed = sorted({name for name, _d, _v in installed_backends()})
    hidden = [n for n in installed if n not in shown]
    parts = []
    if hidden:
        parts.append(
            f"{registry.LIMIT_ENV}={raw!r} hides {len(hidden)} installed "
            f"backend{'s' if len(hidden) != 1 else ''}: {', '.join(hidden)}"
        )
    for name in sorted(allowed - set(installed) - shown):
        parts.append(
            f"{registry.LIMIT_ENV} names {name!r}, which nothing installs"
            + did_you_mean(name, installed)
        )
    return "; ".join(parts) if parts else None


def _cmd_list(args: argparse.Namespace) -> int:
    # A device this process cannot use is refused, as `fusedhead check` refuses it: a probe there
    # would report a backend that does not test for CUDA itself as ok. (--device without --check
    # is refused before: plain `list` never imports torch, which parsing a device needs.)
    device = runnable_device(args.device) if args.device is not None else None
    rows = diagnostics.listing(probe=args.check, device=device)
    note = _limit_note({r.name for r in rows})
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        if note:
            print(f"fusedhead: note: {note}", file=sys.stderr)
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
        if len(table) > 1:
            widths = [max(len(row[i]) for row in table) for i in range(4)]
            for row in table:
                cells = [c.ljust(w) for c, w in zip(row[:4], widths)]
                print("  ".join([*cells, _one_line(row[4])]).rstrip())
        if note:
            print(f"({note})" if len(table) > 1 else f"no backends shown: {note}")
        elif len(table) == 1:
            print(
                "no backends installed; the portable one: " + install_hints.install_command("torch")
            )
    bad = {diagnostics.Status.BROKEN, diagnostics.Status.INCOMPATIBLE, diagnostics.Status.CONFLICT}
    return 1 if args.check and any(r.status in bad for r in rows) else 0


# --- info -------------------------------------------------------------------------------------


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    from fusedhead.config import option_rows, validate_options

    if args.name is None:  # say which names there are, not only that one is required
        names = ", ".join(registry.candidates()) or "none installed"
        raise ValueError(f"info needs a backend name; installed: {names}")  # exit 2
    cand = registry.find(args.name)
    out: dict[str, Any] = {
        "name": cand.name,
        "distribution": cand.distribution,
        "version": cand.version,
        "entry_point": cand.value,
    }
    fields = {"backend": cand.name, "distribution": cand.distribution, "version": cand.version}
    schema: list[dict[str, Any]] | None = None
    try:
        cls = registry.load_class(args.name)
        schema = option_rows(cls.Options)
        device = torch.device(args.device) if args.device else registry.default_device()
        # Its defaults; a required option is an OptionsError naming it (not pydantic's dump).
        options = validate_options(cand.name, cls, {})
        backend = registry.construct_backend(cls, options, **fields)
        caps = registry.backend_capabilities(backend, device, **fields)
    except BackendError as exc:  # a plugin that cannot load, or breaks the contract here
        out["status"] = exc.status
        out["reason"] = str(exc)
        out["error"] = exc.to_dict()
        if schema is not None:  # what it takes is known even where it cannot be built
            out["options_schema"] = schema
        _print_info(out, args.json)
        return 1
    out["plugin_api_version"] = cls.plugin_api_version
    out["device"] = str(device)
    out["capabilities"] = caps.model_dump(mode="json")
    out["options_schema"] = schema
    status, reason = _probe_here(cand, device)
    out["status"] = status.value
    if reason:
        out["reason"] = reason
    describe = getattr(backend, "describe", None)
    if callable(describe):
        out["implementation"] = describe(device)
    out["per_device"] = _per_device(cand, backend, caps, device, fields)
    _print_info(out, args.json)
    return 0


def _probe_here(cand: Any, device: Any) -> tuple[diagnostics.Status, str | None]:
    """``cand``'s status on ``device`` in this process: its probe's, except that a CUDA device
    this process lacks is ``unavailable`` (with ``list --check``'s reason) where the probe says
    ok, as a backend whose ``check()`` does not test for CUDA itself passes there."""
    status, reason = diagnostics.probe_backend(cand, device)
    if status is diagnostics.Status.OK and device.type == "cuda":
        try:
            runnable_device(str(device), flag="device")
        except ValueError as exc:
            return diagnostics.Status.UNAVAILABLE, str(exc)
    return status, reason


def _per_device(
    cand: Any, backend: Any, caps: Any, shown: Any, fields: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """What the backend declares on each device type (the CPU, CUDA and any it names), and its
    status there: capabilities differ by device (triton's bf16 is CUDA-only), so one device's
    list must not read as the backend's. Fields equal to the shown device's are left out."""
    import torch

    declared = caps.model_dump(mode="json")
    rows: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(["cpu", "cuda", *declared.get("devices", [])]):
        device = torch.device(kind)
        row: dict[str, Any] = {}
        try:
            here = registry.backend_capabilities(backend, device, **fields).model_dump(mode="json")
        except BackendError as exc:
            rows[kind] = {"status": exc.status, "reason": str(exc)}
            continue
        row["runs_on_it"] = kind in here.get("devices", [])
        row["dtypes"] = here.get("dtypes", [])
        differs = {
            k: v for k, v in here.items() if k not in ("dtypes", "devices") and declared.get(k) != v
        }
        if differs:
            row["differs"] = differs
        status, reason = _probe_here(cand, device)
        row["status"] = status.value
        if reason:
            row["reason"] = reason
        rows[kind] = row
    return rows


def _print_info(info: dict[str, Any], as_json: bool) -> None:
    from fusedhead.config import option_signature

    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return
    for key, value in info.items():
        if key == "error":
            continue  # its fields are in --json; the reason line says it
        if key == "options_schema":
            print("options (name: allowed values = default):")
            if not value:
                print("  (none)")
            for row in value:
                desc = f"  {row['description']}" if row["description"] else ""
                print(f"  {option_signature(row)}{desc}")
        elif key == "capabilities":
            print(f"{key}:")
            for k, v in value.items():
                if k == "vocab_parallel_outputs" and not value.get("vocab_parallel"):
                    v = "none (vocab_parallel is False)"  # --json keeps the declared default
                if k == "vocab_grid":
                    v = (
                        f"{v} columns (shards starting on a multiple of it give the "
                        "one-process bits at any degree)"
                        if value.get("degree_invariant")
                        else "none (degree_invariant is False)"
                    )
                print(f"  {k}: {v}")
        elif key == "per_device":
            print("per device (declared there; status on this machine):")
            for kind, row in value.items():
                if "dtypes" not in row:
                    print(f"  {kind}: {row['status']}: {row['reason']}")
                    continue
                runs = "" if row["runs_on_it"] else " (not a declared device)"
                line = f"  {kind}{runs}: dtypes {', '.join(row['dtypes']) or 'none'}"
                if row.get("differs"):
                    line += "; " + ", ".join(f"{k}={v}" for k, v in row["differs"].items())
                line += f"; status {row['status']}"
                print(line + (f" ({row['reason']})" if row.get("reason") else ""))
        elif isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v}")
        else:
            print(f"{key}: {value}")


# --- the parser and main ----------------------------------------------------------------------


def build_parser(*, delegated: bool = True) -> argparse.ArgumentParser:
    """The argument parser; ``delegated=False`` skips importing the heavy sub-command modules."""
    parser = _Parser(
        prog="fusedhead",
        description="fusedhead backends: list, inspect, check, bench, demo",
        epilog=f"An error prints one line; {TRACEBACK_ENV}=1 shows its traceback before it.",
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="print the versions of fusedhead and of every installed backend distribution",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    text = "installed backends and their status (metadata only unless --check)"
    p = sub.add_parser("list", help=text, description=_sentence(text))
    p.add_argument("--json", action="store_true", help="print a JSON list of objects")
    p.add_argument(
        "--check",
        action="store_true",
        help="import and probe each backend; exit 1 if any is broken",
    )
    p.add_argument(
        "--device",
        default=None,
        help="device the --check probes run on; only with --check "
        "(default: cuda if present, else cpu)",
    )
    p.set_defaults(func=_cmd_list)
    text = "capabilities, options (their allowed values), distribution and status of a backend"
    # the name is required: optional to argparse only so that its absence lists the names
    usage = "fusedhead info [-h] [--json] [--device DEVICE] name"
    p = sub.add_parser("info", help=text, description=_sentence(text), usage=usage)
    p.add_argument("name", nargs="?", help="backend name (as in `fusedhead list`)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--device",
        default=None,
        type=device_arg,
        help="device to describe, here or not: one this machine lacks shows status unavailable "
        "(default: cuda if present, else cpu)",
    )
    p.set_defaults(func=_cmd_info)
    for name, (module, help_text) in _DELEGATED.items():
        p = sub.add_parser(name, help=help_text, description=_sentence(help_text))
        p.set_defaults(module=module)
        if delegated:
            importlib.import_module(module).add_arguments(p)
            _typed_arguments(p, name)
    return parser


def _sentence(text: str) -> str:
    """A sub-command's one-line help as the first line of its own ``--help``."""
    return text[0].upper() + text[1:] + "."


def _typed_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Give a delegated sub-command's untyped arguments a type that checks them, so errors name
    the flag: every ``--options`` a JSON object, ``check -k`` patterns that each match."""
    types: dict[str, Callable[[str], Any]] = {"--options": json_object}
    if command == "check":
        types["-k"] = property_patterns
    for action in parser._actions:
        for flag, parse in types.items():
            if flag in action.option_strings and action.type is None:
                action.type = parse


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text).strip()


def _fail(message: str, fields: dict[str, Any] | None, args: argparse.Namespace | None) -> None:
    print(f"fusedhead: error: {_one_line(message)}", file=sys.stderr)
    if args is not None and getattr(args, "json", None) is True:
        print(json.dumps({"error": fields or {"message": _one_line(message)}}, indent=2))


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of ``command`` (``parser`` itself where there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            sub: argparse.ArgumentParser = action.choices[command]
            return sub
    return parser


def _check_list_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``check NAME --list`` prints the properties only, yet refuses a device and a name as a run
    does (a typo must not pass unseen); ``--options``, which only the backend's import could
    check, is refused with ``--list``."""
    if getattr(args, "command", None) != "check" or not args.list:
        return
    if args.options is not None:
        _subparser(parser, "check").error(
            "argument --options: not allowed with --list, which reads no backend options"
        )
    runnable_device(args.device)
    registry.find(args.name)


def _list_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``list --device`` without ``--check`` is refused: only the probes run on a device, and a
    plain listing that silently ignored it would read as one made there."""
    if getattr(args, "command", None) != "list" or args.check or args.device is None:
        return
    _subparser(parser, "list").error(
        f"argument --device: applies only with --check (the device the probes run on), "
        f"got --device {args.device!r} without --check"
    )


def _silence_stdout() -> None:
    """Point stdout at the null device, so the interpreter's flush at exit finds no closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; the exit status (0 ok, 1 a failed check, 2 an error, 141 a closed pipe)
    is returned."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args: argparse.Namespace | None = None
    try:
        show_traceback = env_flag(TRACEBACK_ENV)
    except ValueError as exc:
        _fail(str(exc), None, None)
        return EXIT_ERROR
    try:
        parser = build_parser(delegated=command in _DELEGATED)
        args, extra = parser.parse_known_args(argv)
        if extra:  # told by the subcommand's parser, which names its own --help
            _subparser(parser, getattr(args, "command", None)).error(
                f"unrecognized arguments: {' '.join(extra)}"
            )
        _check_list_arguments(parser, args)
        _list_arguments(parser, args)
        result: int
        if hasattr(args, "module"):
            result = importlib.import_module(args.module).run(args)
        else:
            result = args.func(args)
    except SystemExit as exc:  # argparse (--help, --version, a bad argument) or a command's own
        if isinstance(exc, _UsageError) and "--json" in argv:  # its fields, as any error's
            fields = {"error": "UsageError", "status": "error", "message": exc.message}
            print(json.dumps({"error": fields}, indent=2))
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_ERROR)
    except KeyboardInterrupt:
        print("fusedhead: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as `yes | head` does
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        if show_traceback:  # any error, bad input's included; the line and the status unchanged
            _print_traceback(exc)
        return _report(exc, args, traced=show_traceback)
    return result


def _print_traceback(exc: BaseException) -> None:
    """``exc``'s traceback on stderr, ending in a newline: the error line after it starts a line
    of its own."""
    text = "".join(traceback.format_exception(exc))
    sys.stderr.write(text if text.endswith("\n") else text + "\n")
    sys.stderr.flush()


#: A backend's advice in fusedhead's Python terms: ``options={"implementation": "fallback"}``.
_PYTHON_OPTIONS = re.compile(r"\boptions=(\{[^{}]*\})")


def _options_here(message: str, args: argparse.Namespace | None) -> str:
    """Where a backend's advice names options in Python terms, how ``check`` and ``demo`` take
    them (``--options '{...}'``), else ``""``."""
    found = _PYTHON_OPTIONS.search(message)
    if found is None or getattr(args, "command", None) not in ("check", "demo"):
        return ""
    return f" (on this command line, options={found.group(1)} is --options '{found.group(1)}')"


def _report(exc: Exception, args: argparse.Namespace | None, *, traced: bool = False) -> int:
    """One line (or a JSON object) for an error that ends a command, and the exit status;
    ``traced``: its traceback was printed, so the line points to it, not to the variable."""
    if isinstance(exc, BackendError):
        _fail(exc.message + _options_here(exc.message, args), exc.to_dict(), args)
        return EXIT_ERROR
    if isinstance(exc, (ValueError, TypeError, OSError)):  # bad input, a file that is not there
        text = str(exc)
        fields = {"error": type(exc).__name__, "status": "error", "message": _one_line(text)}
        _fail(text, fields, args)
        return EXIT_ERROR
    where = "its traceback is above" if traced else f"{TRACEBACK_ENV}=1 shows where"
    text = f"{type(exc).__name__}: {exc} (an unexpected failure; {where})"
    fields = {"error": type(exc).__name__, "status": "error", "message": _one_line(text)}
    _fail(text, fields, args)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
