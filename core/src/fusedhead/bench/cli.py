"""``fusedhead bench``: arguments and the loop over cases and implementations.

Each case (N, H, V, dtype) gets its inputs, its GEMM unit and its reference once; then every
implementation is measured on it, or recorded as skipped with the reason (cannot run here, would
not fit, time cap). Results are written as they come; a failing implementation is recorded as an
error and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

GPU_DEFAULTS: dict[str, list[Any]] = {
    "n": [1024, 8192, 32768],
    "hidden": [4096],
    "vocab": [32000, 128256, 151936],
    "dtype": ["bf16", "fp32"],
}
CPU_DEFAULTS: dict[str, list[Any]] = {
    "n": [2048],
    "hidden": [1024],
    "vocab": [32000],
    "dtype": ["fp32"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fusedhead bench`` (grid defaults depend on the device: see --help).

    Every number is checked by its argument type, so a bad one names its flag before any work;
    a list flag given again adds to its list (``--n 64 --n 128`` is ``--n 64 128``).
    """
    from fusedhead import cli

    device_arg = cli.device_arg
    positive_int, nonnegative_int = _ascii_int(cli.positive_int), _ascii_int(cli.nonnegative_int)
    reps_int = _ascii_int(cli.reps_int)
    positive_float, positive_number = (
        _ascii_float(cli.positive_float),
        _ascii_float(cli.positive_number),
    )

    g = parser.add_argument_group(
        "grid (defaults: GPU N 1024 8192 32768, H 4096, V 32000 128256 151936, "
        "bf16 fp32; CPU N 2048, H 1024, V 32000, fp32). A list flag given again adds to its "
        "list: --vocab 500 --vocab 1000 measures both"
    )
    sizes = (
        ("--n", "token counts N"),
        ("--hidden", "hidden sizes H"),
        ("--vocab", "vocabulary sizes V"),
    )
    for flag, what in sizes:
        g.add_argument(flag, type=positive_int, nargs="+", action=_Extend, default=None, help=what)
    g.add_argument(
        "--dtype",
        nargs="+",
        action=_Extend,
        default=None,
        choices=["fp32", "fp16", "bf16"],
        help="input dtypes",
    )
    g.add_argument(
        "--temperature", type=positive_float, default=0.7, help="temperature (default 0.7)"
    )
    g.add_argument(
        "--scale",
        type=positive_float,
        nargs="+",
        action=_Extend,
        default=[1.0],
        help="weight scale s, W ~ N(0, (s/sqrt(H))^2): 1 flat, 4 peaked (default 1); one whose "
        "logits would overflow the dtype (fp16: past 65504) is refused",
    )
    g.add_argument(
        "--seed", type=nonnegative_int, default=0, help="generator seed of the inputs (default 0)"
    )
    g.add_argument(
        "--case",
        nargs="+",
        action=_Extend,
        default=None,
        metavar="CASE",
        help="what each call computes: logprobs (default), topk<k>, gather<K> (k, K <= --vocab), "
        "lse, sum_p2, "
        "argmax, kl, kl-reverse (fusedhead backends only), policy (the RL policy loss's forward + "
        "backward; with unfused:NAME and the peers; see fusedhead.bench.heads)",
    )
    parser.add_argument(
        "--impl",
        nargs="+",
        action=_Extend,
        default=None,
        metavar="NAME",
        help="implementations: installed backend names (NAME or 'NAME:{json options}'), "
        "unfused:NAME (--case policy: the backend's log-probs, then the loss in torch) and peers "
        "reference, verl-chunked, liger-direct, cce (default: every installed backend and peer; "
        "with --case policy, unfused:NAME of every installed backend too)",
    )
    parser.add_argument(
        "--device",
        default=None,
        type=device_arg,
        help="cpu, cuda or cuda:K (default: cuda if present)",
    )
    parser.add_argument(
        "--reps",
        type=reps_int,
        default=3,
        help=f"timed repetitions at least, 1 to {cli.MAX_REPS} (median; default 3)",
    )
    parser.add_argument(
        "--max-minutes",
        type=positive_number,
        default=10.0,
        help="skip the remaining measurements once the run has taken this long (default 10)",
    )
    parser.add_argument("--no-memory", action="store_true", help="do not measure peak memory")
    parser.add_argument(
        "--no-accuracy",
        action="store_true",
        help="do not compute the reference and errors (computed for the logprobs and policy "
        "cases; `fusedhead check` holds the other heads to their accuracy)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write results here, one object per measurement, as they come. Each output PATH "
        "(--json, --markdown, --plot) is a regular file, replaced whole at each write; a symlink "
        "is followed (its target is written, the link kept); anything else there (a folder, a "
        "device such as /dev/null, a pipe) is refused; missing folders above it are made",
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="add to the results already in --json. The table then lists them all, with a "
        "column for each of device, temperature, seed, reference, versions and environment "
        "where the results differ in it, and the date of each where a case was measured again; "
        "the plot draws one line per implementation and setting, a case measured again from "
        "its latest result",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="measure nothing: write the table and plot of the results in --json",
    )
    parser.add_argument("--markdown", metavar="PATH", help="write the Markdown table here")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write a plot here, in the format its extension names (.png, .pdf, .svg, ...; "
        "needs matplotlib: the core's bench extra)",
    )


class _Extend(argparse.Action):
    """A list flag given again adds its values (``--impl torch --impl reference`` measures both),
    where argparse's own ``nargs="+"`` keeps only the last; its first values replace the default."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest, None)
        earlier = [] if given is None or given is self.default else list(given)
        setattr(namespace, self.dest, [*earlier, *(values or [])])


#: Numbers as the flags take them: ASCII digits, an optional sign, point and exponent. Python's
#: int() and float() also take other scripts' digits ('٣' is 3), '1_000' and spaces around.
_ASCII_INT = re.compile(r"[+-]?[0-9]+")
_ASCII_FLOAT = re.compile(r"[+-]?([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][+-]?[0-9]+)?")


def _ascii_number(parse: Callable[[str], T], pattern: re.Pattern[str]) -> Callable[[str], T]:
    """``parse`` (a flag's type, whose error names what it takes), for text written in ASCII."""

    def checked(text: str) -> T:
        value = parse(text)  # its own error for what is no number at all, or out of range
        if not pattern.fullmatch(text):
            raise argparse.ArgumentTypeError(
                f"must be written with the ASCII digits 0-9 (no other script's digits, spaces "
                f"or '_'), got {text!r}"
            )
        return value

    checked.__name__ = getattr(parse, "__name__", "number")
    return checked


def _ascii_int(parse: Callable[[str], int]) -> Callable[[str], int]:
    return _ascii_number(parse, _ASCII_INT)


def _ascii_float(parse: Callable[[str], float]) -> Callable[[str], float]:
    return _ascii_number(parse, _ASCII_FLOAT)


#: Arguments that shape or tune the measurements, which ``--report-only`` does not take.
MEASUREMENT_ARGS = (
    "n", "hidden", "vocab", "dtype", "temperature", "scale", "seed", "case", "impl", "device",
    "reps", "max_minutes", "no_memory", "no_accuracy", "append",
)  # fmt: skip
#: The grid's arguments: a value given twice would make two identical cases.
GRID_LISTS = ("case", "n", "hidden", "vocab", "dtype", "scale")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, before any work, what the arguments alone show cannot run as asked: measurement
    arguments with ``--report-only``, a grid value given twice, an implementation with no case
    to run. Each is a ValueError naming the flag."""
    if args.report_only:
        _refuse_measurement_args(args)
        return
    from fusedhead.bench import heads

    for dest in GRID_LISTS:
        values = getattr(args, dest) or []
        # compared as the run reads them: topk05 is topk5, 1 is 1.0, 08 is 8
        same = [heads.canonical(v) for v in values] if dest == "case" else values
        repeated = sorted({str(v) for i, v in enumerate(same) if v in same[:i]})
        if repeated:
            raise ValueError(
                f"--{dest} {' '.join(map(str, values))}: {', '.join(repeated)} given twice; "
                "list each value once (each would make the same cases again)"
            )
    _refuse_policy_only_impls(args.impl or [], args.case or [])


def _refuse_measurement_args(args: argparse.Namespace) -> None:
    """``--report-only`` with an argument it would ignore is refused by name (as demo --model
    refuses the synthetic problem's flags): it measures nothing, so none of them is read."""
    from fusedhead.cli import flags_given

    given = flags_given(args, add_arguments, MEASUREMENT_ARGS)
    if given:
        one = len(given) == 1
        raise ValueError(
            f"--report-only measures nothing, so {', '.join(given)} would be ignored: "
            f"drop {'it' if one else 'them'}, or drop --report-only (it writes the table and "
            "plot of the results in --json)"
        )


def _refuse_policy_only_impls(specs: list[str], cases: list[str]) -> None:
    """An ``unfused:NAME`` implementation runs the ``policy`` case only: without that case among
    ``--case`` it would only be listed as skipped."""
    from fusedhead.bench import policy
    from fusedhead.bench.peers import UNFUSED

    if policy.NAME in cases:
        return
    for spec in specs:
        if spec.startswith(UNFUSED):
            raise ValueError(
                f"--impl {spec} runs the {policy.NAME} case only (a backend's log-probs, then "
                f"the loss in torch), but --case is {' '.join(cases) or 'logprobs (the default)'}: "
                f"add --case {policy.NAME}, or drop {spec}"
            )


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, an output path that could not be written at the end of a run.

    A folder where a file goes, an existing path that is not a regular file (a device such as
    /dev/null, a pipe: the atomic write would replace it), a file where a folder goes, a folder
    that cannot be created or written, a plot path whose extension names no format matplotlib
    writes, ``--append`` without ``--json``: each is a ValueError naming the flag (a run of hours
    must not end in an error writing its table). A symlink is followed: its target is checked,
    and written later (``results_file.write_file``).
    """

    for flag, value in (
        ("--json", args.json),
        ("--markdown", args.markdown),
        ("--plot", args.plot),
    ):
        if value is not None and not value.strip():  # "" would write nothing, silently
            raise ValueError(
                f"{flag} {value!r}: an empty path; give a file path, or leave out {flag}"
            )
    if args.append and not args.json:
        raise ValueError("--append adds to the results in --json PATH: give --json too")
    given = [(f, v) for f, v in (("--json", args.json), ("--markdown", args.markdown),
                                 ("--plot", args.plot)) if v]  # fmt: skip
    for i, (flag, value) in enumerate(given):
        for other, other_value in given[i + 1 :]:
            if _target(flag, value) == _target(other, other_value):
                raise ValueError(
                    f"{flag} {value} and {other} {other_value} are the same file: one would "
                    "overwrite the other; give each output its own path"
                )
    for flag, value in (
        ("--json", args.json),
        ("--markdown", args.markdown),
        ("--plot", args.plot),
    ):
        if not value or (flag == "--json" and args.report_only):  # read, not written
            continue
        path = _target(flag, value)
        if path.is_dir():
            raise ValueError(f"{flag} {value}: is a folder; give a file path in it")
        _refuse_special(flag, value, path)
        if path.exists() and (why := _cannot_write(path)):
            raise ValueError(f"{flag} {value}: the file is not writable ({why})")
        folder = path.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent  # the nearest existing ancestor: made into the folder later
        if not folder.is_dir():
            raise ValueError(f"{flag} {value}: {folder} is a file, not a folder")
        if not path.exists() and (why := _cannot_create(path, folder)):
            raise ValueError(f"{flag} {value}: {why}")
    if args.append and Path(args.json).is_file():
        read_results(args.json, "--append: --json")  # what it adds to must be earlier results
    if args.plot:
        suffix = Path(args.plot).suffix.lower().lstrip(".")
        if not suffix:  # matplotlib would write PATH.png, a file no check saw
            raise ValueError(
                f"--plot {args.plot}: no extension to name the format; expected a path ending in "
                f"one matplotlib writes (e.g. {args.plot}.png, or .pdf, .svg)"
            )
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            return  # the plot is skipped with a note at the end (matplotlib, the core's bench extra)
        formats = FigureCanvasBase.get_supported_filetypes()
        if suffix not in formats:
            raise ValueError(
                f"--plot {args.plot}: matplotlib writes no {suffix!r} file; "
                f"use one of {', '.join(sorted(formats))} (e.g. bench.png)"
            )


def _target(flag: str, value: str) -> Path:
    """The file an output ``value`` names: absolute, symlinks followed (their target is what is
    written); a symlink loop is a ValueError naming the flag."""
    try:
        return Path(value).resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a loop (Python < 3.13)
        raise ValueError(f"{flag} {value}: cannot be followed to a file ({exc})") from None


def _refuse_special(flag: str, value: str, path: Path) -> None:
    """A ValueError where ``value`` (whose target is ``path``) exists and is no regular file:
    each write makes a new file renamed over it, which would replace a device such as /dev/null,
    and a read of a pipe would wait for ever."""
    from fusedhead.bench.results_file import file_kind

    if not path.exists() or path.is_file():
        return
    link = f"a symlink to {path}, " if Path(value).is_symlink() else ""
    raise ValueError(
        f"{flag} {value}: {link}{file_kind(path)}, not a regular file; expected the path of a "
        "regular file or of none yet (each write replaces the file whole)"
    )


def _cannot_write(path: Path) -> str | None:
    """Why the existing file ``path`` cannot be written, or None: tried (opened to append, which
    changes nothing), not asked of ``os.access``, which says yes to root on a read-only or
    virtual file system (/proc)."""
    try:
        path.open("a").close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _cannot_create(path: Path, folder: Path) -> str | None:
    """Why the file ``path`` (or, where its folder does not exist yet, that folder's first new
    part, under the existing ``folder``) cannot be created, with the OS's own reason, or None.
    It is created and removed again: only a try tells (``os.access`` says yes to root in /proc)."""
    target = folder / path.relative_to(folder).parts[0]  # the file, or its first new folder
    try:
        if target == path:
            path.open("x").close()
            path.unlink()
        else:
            target.mkdir()
            target.rmdir()
    except OSError as exc:
        what = "the file" if target == path else f"the folder {target}"
        return f"{what} cannot be created ({exc.strerror or type(exc).__name__})"
    return None


def read_results(path: str, flag: str) -> list[dict[str, Any]]:
    """The JSON list of results that an earlier ``--json PATH`` wrote, or a ValueError naming it:
    each item an object whose fields the table and the plot read have the types the bench
    writes (``RESULT_FIELDS``), checked here, before any measuring."""
    from fusedhead.bench.results_file import file_kind
    from fusedhead.cli import json_type

    target = _target(flag, path)
    if target.exists() and not target.is_file():  # a pipe would be read for ever
        raise ValueError(f"{flag} {path}: {file_kind(target)}, not a regular file of results")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(
            f"{flag} {path}: No such file (it reads an earlier run's --json)"
        ) from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: not a results file ({exc})") from None
    try:
        records = json.loads(text or "[]")
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{flag} {path}: not the JSON list that fusedhead bench --json writes "
            f"({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    if not isinstance(records, list):
        raise ValueError(
            f"{flag} {path}: holds a JSON {json_type(records)}, not the list of results "
            "that fusedhead bench --json writes"
        )
    for i, record in enumerate(records):
        why = _not_a_result(record)
        if why:
            raise ValueError(
                f"{flag} {path}: item {i} is not a result that fusedhead bench --json writes "
                f"({why})"
            )
    return records


#: What the table needs of a result: its case's fields, the implementation and the status.
RESULT_CASE_FIELDS = ("n", "hidden", "vocab", "dtype")


def _is_int(value: Any, low: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value: Any) -> bool:
    """A JSON number (NaN and infinities included: the bench writes them), not a boolean."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_line(value: Any) -> bool:
    """A non-empty string of one line of text (a table cell), all of it writable as UTF-8."""
    return isinstance(value, str) and value.isprintable() and value != "" and _utf8(value)


def _utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: JSON's "\udcff"
        return False
    return True


def _or_null(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _is_errors(value: Any) -> bool:
    """``errors``: per output, null or an object with a number ``rel`` (the table shows it)."""
    return isinstance(value, dict) and all(
        e is None or (isinstance(e, dict) and _is_number(e.get("rel"))) for e in value.values()
    )


_TEXT = (lambda v: isinstance(v, str) and _utf8(v), "a string")
_NUMBER_OR_NULL = (_or_null(_is_number), "a number or null")
_OBJECT_OR_NULL = (_or_null(lambda v: isinstance(v, dict)), "an object or null")
#: A result's times, memory and spread: numbers, or null where not measured.
_NUMBER_FIELDS = ("fwd_units", "fwd_bwd_units", "fwd_ms", "fwd_bwd_ms", "unit_ms", "gemm_ms",
                  "peak_extra_bytes", "unit_spread")  # fmt: skip
#: What the table, the plot and the progress lines read of a result's case, and what each is.
RESULT_CASE_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_is_int, "an integer >= 1"),
    "hidden": (_is_int, "an integer >= 1"),
    "vocab": (_is_int, "an integer >= 1"),
    "dtype": (_is_line, "a dtype's name, one line of text"),
    "scale": (lambda v: _is_number(v) and math.isfinite(v) and v > 0, "a finite number > 0"),
    "temperature": (
        lambda v: _is_number(v) and math.isfinite(v) and v > 0,
        "a finite number > 0",
    ),
    "seed": (lambda v: _is_int(v, 0), "an integer >= 0"),
    "head": (_is_line, "a case's name, one line of text"),
}
#: The same of the result itself (``case`` apart); a field not named here is not read.
RESULT_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "impl": (_is_line, "an implementation's name, one line of text"),
    "status": (lambda v: v in ("ok", "skipped", "error"), '"ok", "skipped" or "error"'),
    "date": _TEXT,
    "entropy": (lambda v: isinstance(v, bool), "true or false"),
    "reason": (_or_null(_TEXT[0]), "a string or null"),
    "error": (_or_null(_TEXT[0]), "a string or null"),
    "reference_dtype": (_or_null(_TEXT[0]), "a string or null"),
    "errors": (_or_null(_is_errors), 'null or an object of null or {"rel": number} per output'),
    "device": (lambda v: isinstance(v, dict), "an object"),
    "versions": _OBJECT_OR_NULL,
    "environment": _OBJECT_OR_NULL,
    "unit_runs": (_or_null(lambda v: _is_int(v, 0)), "an integer >= 0 or null"),
    **dict.fromkeys(_NUMBER_FIELDS, _NUMBER_OR_NULL),
}


def _not_a_result(record: Any) -> str | None:
    """Why ``record`` is not one result object, or None."""
    from fusedhead.cli import json_type

    if not isinstance(record, dict):
        return f"a JSON {json_type(record)}, not an object"
    missing = [k for k in ("case", "impl", "status") if k not in record]
    if missing:
        return f"no {', '.join(map(repr, missing))}"
    case = record["case"]
    if not isinstance(case, dict):
        return f"'case' is a JSON {json_type(case)}, not an object"
    missing = [k for k in RESULT_CASE_FIELDS if k not in case]
    if missing:
        return f"its case has no {', '.join(map(repr, missing))}"
    for prefix, fields, types in (("case.", case, RESULT_CASE_TYPES), ("", record, RESULT_FIELDS)):
        for key, (check, expected) in types.items():
            if key in fields and not check(fields[key]):
                value = fields[key]
                shown = json.dumps(value, ensure_ascii=True)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                return f"'{prefix}{key}' is {shown}, a JSON {json_type(value)}; expected {expected}"
    return None


def run(args: argparse.Namespace) -> int:
    """Run the grid; exit 0 when every attempted measurement succeeded and at least one ran,
    1 otherwise."""
    check_arguments(args)
    check_outputs(args)
    if args.report_only:
        return _report_only(args)
    import signal

    import torch

    def _terminated(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through `finally`: the table and plot get written

    signal.signal(signal.SIGTERM, _terminated)

    from fusedhead.bench import accuracy, peers, policy, provenance, report, results_file, timing
    from fusedhead.bench.cases import grid, make_inputs, refuse_unfit
    from fusedhead.bench.measure import measure
    from fusedhead.cli import runnable_device

    device = runnable_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        timing.disable_tf32()
    elif device.type != "cpu":
        raise ValueError(f"--device must be cpu or cuda[:K], got {device}")
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    cases = grid(
        args.n or defaults["n"],
        args.hidden or defaults["hidden"],
        args.vocab or defaults["vocab"],
        args.dtype or defaults["dtype"],
        temperature=args.temperature,
        scales=args.scale,
        heads=args.case,
        seed=args.seed,
        device=str(device),
    )
    specs = args.impl or peers.default_specs(c.head for c in cases)
    # Unknown names and bad options fail here, before any work.
    impls = [peers.resolve(s) for s in specs]
    _refuse_repeats(specs, impls)
    resolved = {
        "n": sorted({c.n for c in cases}),
        "hidden": _distinct_in_order(c.hidden for c in cases),
        "vocab": _distinct_in_order(c.vocab for c in cases),
        "dtype": _distinct_in_order(c.dtype for c in cases),
        "case": _distinct_in_order(c.head for c in cases),
        "impl": specs,
        "device": str(device),
    }
    common = {
        "device": provenance.device_info(device),
        "versions": provenance.versions(),
        "environment": peers.environment_note(),
        "run": _run_settings(args, resolved),
    }
    writer = results_file.JsonWriter(args.json, append=args.append, flag="--json")
    progress = report.Progress(len(cases) * len(impls))
    deadline = progress.start + 60.0 * args.max_minutes
    failures = 0
    progress.line(
        f"{len(cases)} case(s) x {len(impls)} implementation(s) on {common['device']['name']}"
    )
    try:
        for case in cases:
            if time.monotonic() > deadline:
                for impl in impls:
                    writer.add(
                        _record(
                            case,
                            impl,
                            common,
                            status="skipped",
                            reason=f"time cap of {args.max_minutes:g} min reached",
                        )
                    )
                    progress.done += 1
                continue
            blocked = {impl.name: _blocked(impl, case) for impl in impls}
            if all(blocked.values()):
                for impl in impls:
                    status, why = blocked[impl.name]  # type: ignore[misc]
                    failures += status == "error"
                    key = "error" if status == "error" else "reason"
                    writer.add(_record(case, impl, common, status=status, **{key: why}))
                    progress.done += 1
                    progress.line(f"{case.label()} {report.summary_line(writer.records[-1])}")
                continue
            progress.line(f"{case.label()}: inputs, GEMM unit, reference")
            inputs = None
            ref: accuracy.Reference | policy.Reference | None = None
            try:
                refuse_unfit([case], device)  # in a second, not after building the inputs
                inputs = make_inputs(case)
                unit_ms = timing.gemm_ms(inputs.hidden, inputs.weight, reps=args.reps)
                ref_s = None
                if not args.no_accuracy and case.head == "logprobs":  # the kit checks the others
                    t0 = time.perf_counter()
                    need_lp = any(not i.entropy and not blocked[i.name] for i in impls)
                    ref = accuracy.compute_reference(case, inputs, lp_only_grads=need_lp)
                    ref_s = time.perf_counter() - t0
                elif not args.no_accuracy and case.head == policy.NAME:
                    t0 = time.perf_counter()
                    ref = policy.compute_reference(case, inputs)
                    ref_s = time.perf_counter() - t0
            except Exception as exc:  # e.g. inputs that do not fit: this case only
                why = (
                    f"the case's inputs, GEMM unit or reference failed: {type(exc).__name__}: {exc}"
                )
                for impl in impls:
                    status, reason = blocked[impl.name] or ("error", why)
                    failures += status == "error"
                    key = "error" if status == "error" else "reason"
                    writer.add(_record(case, impl, common, status=status, **{key: reason}))
                    progress.done += 1
                    progress.line(f"{case.label()} {report.summary_line(writer.records[-1])}")
                del inputs, ref
                _free(device)
                continue
            tflops = 2.0 * case.n * case.hidden * case.vocab / (unit_ms * 1e-3) / 1e12
            progress.line(f"{case.label()}: GEMM unit {unit_ms:.3f} ms ({tflops:.1f} TFLOP/s)")
            extra = {
                "gemm_ms": unit_ms,
                "gemm_tflops": tflops,
                "reference_seconds": ref_s,
                "reference_dtype": None if ref is None else str(ref.dtype).replace("torch.", ""),
            }
            for impl in impls:
                block = blocked[impl.name]
                if not block and time.monotonic() > deadline:
                    block = ("skipped", f"time cap of {args.max_minutes:g} min reached")
                if not block and impl.name == "reference":
                    block = _blocked(impl, case)  # free memory now, with this case's tensors held
                if block:
                    failures += block[0] == "error"
                    key = "error" if block[0] == "error" else "reason"
                    rec = _record(case, impl, common, status=block[0], **{key: block[1]}, **extra)
                else:
                    progress.line(f"{case.label()} {impl.name}: running")
                    try:
                        result = measure(
                            case,
                            impl,
                            inputs,
                            ref,
                            unit_ms=unit_ms,
                            reps=args.reps,
                            measure_memory=not args.no_memory,
                        )
                        status, why = "ok", _nonfinite(result, case)
                        if why:  # a NaN is no measurement: an error, and the exit says so
                            failures += 1
                            status, result = "error", {"error": why, **result}
                        rec = _record(case, impl, common, status=status, **extra, **result)
                    except Exception as exc:
                        failures += 1
                        rec = _record(
                            case,
                            impl,
                            common,
                            status="error",
                            error=f"{type(exc).__name__}: {exc}",
                            traceback=traceback.format_exc(limit=8),
                            **extra,
                        )
                    _free(device)
                writer.add(rec)
                progress.done += 1
                progress.line(f"{case.label()} {report.summary_line(rec)}")
            del inputs, ref
            _free(device)
    finally:
        _finish(args, writer.records, report)
    if not any(r["status"] == "ok" for r in writer.records):
        print("fusedhead bench: nothing was measured (the reasons are listed above)")
        return 1
    return 1 if failures else 0


def _nonfinite(result: dict[str, Any], case: Any) -> str | None:
    """Why a measurement's errors cannot be trusted (a NaN, or an infinite max abs: the outputs
    or gradients hold NaN or inf), or None."""
    bad = [
        name
        for name, e in (result.get("errors") or {}).items()
        if e is not None
        and (
            any(isinstance(v, float) and math.isnan(v) for v in e.values())
            or not math.isfinite(e.get("max_abs", 0.0))
        )
    ]
    bad += [name for name in result.get("nonfinite") or () if name not in bad]
    if not bad:
        return None
    return (
        f"NaN or inf in {', '.join(bad)}: the implementation's outputs or "
        f"gradients are not finite (an overflow of {case.dtype} at --scale {case.scale:g} and "
        f"--temperature {case.temperature:g}, or a fault of the implementation)"
    )


def _run_settings(args: argparse.Namespace, resolved: dict[str, Any]) -> dict[str, Any]:
    """How the run was asked for (every option of the command line, defaults filled in), so a
    record says how it was made: repetitions, time cap, memory and accuracy steps, the grid.
    ``resolved`` holds what the run made of the grid's flags (the device's default sizes and
    dtypes, the cases by their recorded names, the implementations and the device it ran)."""
    skip = {"func", "module", "command", "version", "json", "markdown", "plot", "append"}
    skip.add("report_only")
    settings = {k: v for k, v in vars(args).items() if k not in skip}
    return dict(sorted({**settings, **resolved}.items()))


def _distinct_in_order(values: Iterable[T]) -> list[T]:
    """``values`` each once, in first-seen order."""
    return list(dict.fromkeys(values))


def _report_only(args: argparse.Namespace) -> int:
    from fusedhead.bench import report

    if not args.json:
        raise ValueError("--report-only needs --json PATH with earlier results")
    records = read_results(args.json, "--report-only: --json")
    _finish(args, records, report)
    return 0


def _refuse_repeats(specs: list[str], impls: list[Any]) -> None:
    """A ValueError where two ``--impl`` specs name one implementation (``triton`` and
    ``triton:{}``): it would be measured twice and its records could not be told apart."""
    first: dict[str, str] = {}
    for spec, impl in zip(specs, impls, strict=True):
        if impl.name in first:
            raise ValueError(
                f"--impl {first[impl.name]!r} and {spec!r} name the same implementation "
                f"{impl.name!r}: list each implementation once"
            )
        first[impl.name] = spec


def _blocked(impl: Any, case: Any) -> tuple[str, str] | None:
    """Why ``impl`` will not be measured on ``case``: ("skipped", reason), ("error", what), or None."""
    try:
        reason = impl.availability(case)
    except Exception as exc:  # a backend that does not load or whose probe breaks
        return ("error", f"{type(exc).__name__}: {exc}")
    return ("skipped", reason) if reason else None


def _record(
    case: Any, impl: Any, common: dict[str, Any], *, status: str, **fields: Any
) -> dict[str, Any]:
    from fusedhead.bench import provenance

    return {
        "case": case.to_dict(),
        "impl": impl.name,
        "spec": impl.spec,
        "kind": impl.kind,
        "entropy": impl.entropy,
        "note": impl.note,
        "impl_versions": impl.versions(),
        "status": status,
        "date": provenance.now_iso(),
        **common,
        **fields,
    }


def _free(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class InternalError(RuntimeError):
    """A fault of ``fusedhead bench`` itself, not of the arguments or files it was given: the
    command line reports it as an unexpected failure (exit 1), never as bad input (exit 2)."""


def _internal(what: str, exc: Exception) -> InternalError:
    """``exc``, raised while making ``what`` of results the bench wrote or checked
    (``read_results``), as the bench's own fault."""
    return InternalError(
        f"{what} could not be made of the results ({type(exc).__name__}: {exc}): a fault of "
        "fusedhead bench, not of the results or the arguments; please report it"
    )


def _finish(args: argparse.Namespace, records: list[dict[str, Any]], report: Any) -> None:
    """Print the table, then write it to --markdown and the plot to --plot; a write that fails
    is an OSError naming its flag and path (the other output still written). Any other failure
    to make the table or the plot is an ``InternalError``: the records are the bench's own or
    were checked when read, so it is no fault of the input."""
    from fusedhead.bench import results_file

    try:
        table = report.markdown(records)
    except Exception as exc:
        raise _internal("the Markdown table", exc) from exc
    print(table)
    failed: list[str] = []
    if args.markdown:
        try:
            results_file.write_file(Path(args.markdown), table, "--markdown")
        except OSError as exc:
            failed.append(str(exc))
    if args.plot and records:
        try:
            report.plot(records, args.plot, fmt=Path(args.plot).suffix.lstrip(".").lower())
        except OSError as exc:
            failed.append(str(exc))
        except Exception as exc:
            raise _internal(f"the plot ({args.plot})", exc) from exc
    if failed:
        raise OSError("; ".join(failed) + " (the table is printed above)")
