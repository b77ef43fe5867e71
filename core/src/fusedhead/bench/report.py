"""Results shown: progress lines, a one-line summary per measurement, the Markdown table and the
PNG plots of the records (``results_file`` writes them, ``provenance`` says where they ran).
Plots need matplotlib (``pip install 'fusedhead[bench]'``).
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fusedhead.bench.results_file import write_file

GiB = float(1 << 30)


class Progress:
    """Plain progress lines on stderr: index, elapsed time, what is running or what came out."""

    def __init__(self, total: int, stream: Any = None) -> None:
        self.total = total
        self.done = 0
        self.start = time.monotonic()
        self.stream = stream or sys.stderr

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def line(self, text: str) -> None:
        m, s = divmod(int(self.elapsed()), 60)
        print(f"[{self.done}/{self.total} {m}:{s:02d}] {text}", file=self.stream, flush=True)


# --- formatting ---------------------------------------------------------------------------------


def _f(value: float | None, fmt: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return format(value, fmt)


def _err(record: dict[str, Any], key: str) -> str:
    errors = record.get("errors") or {}
    e = errors.get(key)
    if e is None:
        return "n/a"
    return _f(e["rel"], ".1e")


def summary_line(record: dict[str, Any]) -> str:
    """One line per measurement for the progress display."""
    name = record["impl"]
    if record["status"] != "ok":
        return f"{name}: {record['status']}: {record.get('reason') or record.get('error')}"
    mem = record.get("peak_extra_bytes")
    mem_s = "-" if mem is None else f"{mem / GiB:.2f} GiB"
    stats = (
        f"loss {_err(record, 'loss')}"
        if _has_loss(record)
        else f"lp {_err(record, 'log_probs')} ent {_err(record, 'entropy')}"
    )
    return (
        f"{name}: fwd {_f(record.get('fwd_units'))} u, fwd+bwd {_f(record.get('fwd_bwd_units'))} u "
        f"({_f(record.get('fwd_bwd_ms'), '.1f')} ms), peak extra {mem_s}, "
        f"err {stats} dh {_err(record, 'grad_hidden')} dW {_err(record, 'grad_weight')}"
    )


def _has_loss(record: dict[str, Any]) -> bool:
    """Whether the record measured a loss (the ``policy`` case), not per-token outputs."""
    return (record.get("case") or {}).get("head") == "policy" or bool(
        (record.get("errors") or {}).get("loss")
    )


def _dtype_scale(case: dict[str, Any]) -> str:
    """The dtype, with the weight scale when it is not the flat default (s=4: peaked)."""
    scale = case.get("scale", 1.0)
    return str(case["dtype"]) if scale == 1.0 else f"{case['dtype']} s={scale:g}"


def _case_key(record: dict[str, Any]) -> tuple[Any, ...]:
    c = record["case"]
    return (c["dtype"], c["hidden"], c["vocab"], c.get("scale", 1.0), c["n"], c.get("head", ""))


def _with_head(impl: str, case: dict[str, Any]) -> str:
    """The implementation's name, followed by the head case when it is not ``logprobs``."""
    head = case.get("head", "logprobs")
    return impl if head == "logprobs" else f"{impl} {head}"


def _distinct(values: Iterable[Any]) -> list[Any]:
    """The values in first-seen order, each once (falsy ones left out)."""
    out: list[Any] = []
    for v in values:
        if v and v not in out:
            out.append(v)
    return out


def _device_label(record: dict[str, Any]) -> str:
    """The machine a result was measured on, as the report names it (a CPU with its cores)."""
    d = record.get("device") or {}
    cores = d.get("cores") if d.get("type") == "cpu" else None
    return f"{d.get('name', '-')}" + ("" if cores is None else f" ({cores} cores)")


def _canonical(value: Any) -> str:
    """``value`` (a result's versions or environment) as one comparable, hashable string."""
    return json.dumps(value or {}, sort_keys=True, default=str)


def _setting_key(record: dict[str, Any]) -> tuple[Any, ...]:
    """What a result was measured at besides its shape and N: the device, the temperature and
    seed of its inputs, the implementation and its case, the versions and the environment.
    Results that share it and the shape are points of one line of the plot."""
    c = record["case"]
    return (
        _device_label(record),
        c.get("temperature"),
        c.get("seed"),
        _with_head(record["impl"], c),
        _canonical(record.get("versions")),
        _canonical(record.get("environment")),
    )


def _measurement_key(record: dict[str, Any]) -> tuple[Any, ...]:
    """Results that share this measured the same thing (``--append`` measuring a case again)."""
    c = record["case"]
    shape = (c["n"], c["hidden"], c["vocab"], c["dtype"], c.get("scale", 1.0))
    return (*shape, *_setting_key(record))


def latest(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The measured (``ok``) results, each case measured again (``--append``: the same shape and
    N, implementation, device, temperature, seed, versions and environment) by its latest result
    only: the latest ``date``, the later in the list on a tie. In the order of ``records``."""
    ok = [r for r in records if r["status"] == "ok"]
    chosen: dict[tuple[Any, ...], tuple[str, int]] = {}
    for i, r in enumerate(ok):
        key, date = _measurement_key(r), str(r.get("date") or "")
        if key not in chosen or date >= chosen[key][0]:
            chosen[key] = (date, i)
    keep = {i for _, i in chosen.values()}
    return [r for i, r in enumerate(ok) if i in keep]


def _differing(dicts: list[dict[str, Any]]) -> list[str]:
    """The keys whose values are not the same in all ``dicts`` (first-seen order)."""
    keys = _distinct(k for d in dicts for k in d)
    return [k for k in keys if len({_canonical(d.get(k)) for d in dicts}) > 1]


Panel = tuple[str, int, int, str, float, "float | None", "int | None"]


def plot_series(records: Iterable[dict[str, Any]]) -> dict[Panel, dict[str, list[dict[str, Any]]]]:
    """What ``plot`` draws: panels keyed by (device, H, V, dtype, weight scale, temperature,
    seed), each holding its lines, a label to its results in order of N (``latest`` of each).

    A line is one implementation and case at one setting: results of other devices,
    temperatures or seeds are in other panels, and results of other versions or environments
    are other lines, labelled by what differs, never points of the same line. Appended runs
    of the same setting extend its line; a case measured again is its latest result."""
    panels: dict[Panel, dict[tuple[str, str, str], list[dict[str, Any]]]] = {}
    for r in latest(records):
        c = r["case"]
        panel: Panel = (
            _device_label(r),
            c["hidden"],
            c["vocab"],
            c["dtype"],
            c.get("scale", 1.0),
            c.get("temperature"),
            c.get("seed"),
        )
        line = _setting_key(r)[3:]  # the implementation and case, the versions, the environment
        panels.setdefault(panel, {}).setdefault(line, []).append(r)
    out: dict[Panel, dict[str, list[dict[str, Any]]]] = {}
    for panel, lines in panels.items():
        out[panel] = {}
        for (name, versions, environment), recs in lines.items():
            same_name = [k for k in lines if k[0] == name]
            label = name
            if len(same_name) > 1:  # told apart by what differs: versions, then environment
                parts = []
                for field in (1, 2):
                    dicts = [json.loads(k[field]) for k in same_name]
                    mine = json.loads((name, versions, environment)[field])
                    parts += [f"{k} {mine.get(k, '-')}" for k in _differing(dicts)]
                label = f"{name} [{', '.join(parts)}]"
            out[panel][label] = sorted(recs, key=lambda r: int(r["case"]["n"]))
    return out


def _panel_order(panel: Panel) -> tuple[Any, ...]:
    """A sort key of panels whose temperature or seed may be missing (older results)."""
    return tuple((v is None, 0 if v is None else v) for v in panel)


def _provenance(records: list[dict[str, Any]]) -> str:
    """When, on what and with which versions and settings the records were measured: every value
    that occurs, so that appended runs of other trees or settings are not hidden behind the first."""
    dates = sorted(str(r["date"]) for r in records if r.get("date"))
    when = "-" if not dates else dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    devices = _distinct(_device_label(r) for r in records)
    keys = _distinct(k for r in records for k in (r.get("versions") or {}))
    shown = []
    for k in keys:
        vals = _distinct((r.get("versions") or {}).get(k) for r in records)
        if vals:
            shown.append(f"{k} {' / '.join(map(str, vals))}")
    envs = _distinct(
        ", ".join(f"{k}={v}" for k, v in sorted((r.get("environment") or {}).items()))
        for r in records
    )
    text = f"Measured {when} on {' / '.join(devices) or '-'}; {', '.join(shown)}."
    settings = [
        f"{name} {' / '.join(map(str, vals))}"
        for name, vals in (
            ("T", _distinct(_temperature(r) for r in records)),
            ("seed", _distinct(_seed(r) for r in records)),
            ("reps", _distinct(str((r.get("run") or {}).get("reps", "-")) for r in records)),
        )
        if vals
    ]
    text += f" Settings: {', '.join(settings)}."
    if envs:
        text += f" Environment: {' / '.join(envs)}."
    return text


#: A paired GEMM's slowest run over its fastest (or its median over the GEMM timed alone, either
#: way) beyond which the report says to compare in ms.
UNSTEADY_SPREAD = 1.5


def _unsteady(record: dict[str, Any]) -> str:
    """Why ``record``'s GEMM unit cannot be trusted, or "": its paired runs spread, one run alone,
    or a paired median far from the GEMM timed alone (every paired run slowed alike: a tiny GEMM
    waking a loaded machine's thread pool after the implementation ran)."""
    spread, runs = record.get("unit_spread"), record.get("unit_runs")
    if runs == 1:
        return "one run (raise --reps)"
    if spread is not None and spread > UNSTEADY_SPREAD:
        return f"{spread:.1f}x"
    paired, alone = record.get("unit_ms"), record.get("gemm_ms")
    if paired and alone and max(paired / alone, alone / paired) > UNSTEADY_SPREAD:
        return f"paired median {paired:.3g} ms, alone {alone:.3g} ms"
    return ""


Column = tuple[str, Callable[[dict[str, Any]], str]]


def _temperature(record: dict[str, Any]) -> str:
    t = record["case"].get("temperature")
    return "-" if t is None else format(t, "g")


def _seed(record: dict[str, Any]) -> str:
    seed = record["case"].get("seed")
    return "-" if seed is None else str(seed)


def _reference(record: dict[str, Any]) -> str:
    return str(record.get("reference_dtype") or "-")


def _settings(records: list[dict[str, Any]], *, reference: bool = True) -> list[Column]:
    """The columns that tell results apart beyond their case, each only where ``records`` differ
    in it (``--append`` adds results of other runs): the device, the temperature, the seed, the
    reference (two or more named), the versions and the environment that differ, and the date
    where a case was measured more than once at one setting."""
    versions = _differing([r.get("versions") or {} for r in records])
    columns: list[Column] = [
        ("device", _device_label),
        ("T", _temperature),
        ("seed", _seed),
        (
            "versions",
            lambda r: ", ".join(f"{k} {(r.get('versions') or {}).get(k, '-')}" for k in versions),
        ),
        (
            "environment",
            lambda r: (
                ", ".join(f"{k}={v}" for k, v in sorted((r.get("environment") or {}).items()))
                or "-"
            ),
        ),
    ]
    shown = [(name, get) for name, get in columns if len({get(r) for r in records}) > 1]
    if reference and len({r.get("reference_dtype") for r in records} - {None}) > 1:
        shown.insert(3, ("reference", _reference))
    if len({_measurement_key(r) for r in records}) < len(records):
        shown.append(("measured", lambda r: str(r.get("date") or "-")))
    return shown


def _where(record: dict[str, Any], columns: list[Column]) -> str:
    """``record``'s values of ``columns``, for a line of a list under the table (or "")."""
    if not columns:
        return ""
    return " (" + ", ".join(f"{name} {get(record)}" for name, get in columns) + ")"


def _row_order(record: dict[str, Any]) -> tuple[Any, ...]:
    """Rows by device, then case (``_case_key``), then temperature, seed and date."""
    c = record["case"]
    temperature, seed = c.get("temperature"), c.get("seed")
    return (
        _device_label(record),
        *_case_key(record),
        (temperature is None, temperature or 0.0),
        (seed is None, seed or 0),
        str(record.get("date") or ""),
    )


def markdown(records: Iterable[dict[str, Any]]) -> str:
    """A Markdown table of the measured cases, then the skipped ones with reasons.

    Every result is a row, those that ``--append`` added included: where the rows differ in
    their device, temperature, seed, reference, versions or environment, a column names each
    row's (``_settings``), and a case measured again at one setting has a row per measurement,
    dated."""
    given = list(records)
    if not given:
        return "(no results)\n"
    records = sorted(given, key=_row_order)
    ok = [r for r in records if r["status"] == "ok"]
    # from every row: a row whose errors failed (NaN gradients) still had its reference
    references = _distinct(r.get("reference_dtype") for r in records)
    losses = any(_has_loss(r) for r in records)
    columns = _settings(ok)
    if len(references) > 1:
        against = (
            "; errors are relative L2 against the reference named in each row "
            f"({' / '.join(map(str, references))}) on the same input values."
        )
    elif references:
        against = (
            f"; errors are relative L2 against a {references[0]} reference on the same input "
            "values."
        )
    else:
        against = "; no reference was computed, so no errors are shown."
    heads = ["N", "H", "V", "dtype", *(name for name, _ in columns), "implementation"]
    heads += ["GEMM unit (ms)", "fwd (units)", "fwd+bwd (units)", "fwd+bwd (ms)"]
    heads += ["peak extra (GiB)", "log-prob err", "entropy err", "grad h err", "grad W err"]
    heads += ["loss err"] if losses else []
    left = {"dtype", "implementation", *(name for name, _ in columns)}
    lines = [
        _provenance(given),  # in the order of the file: the first run's versions first
        "Times in GEMM units (one `hidden @ weight.T` of the case's shape and dtype)" + against,
        "",
        "| " + " | ".join(heads) + " |",
        "| " + " | ".join("---" if h in left else "---:" for h in heads) + " |",
    ]
    for r in ok:
        c = r["case"]
        mem = r.get("peak_extra_bytes")
        name = _with_head(r["impl"], c) + ("" if r.get("entropy", True) else " (no entropy)")
        cells = [str(c["n"]), str(c["hidden"]), str(c["vocab"]), _dtype_scale(c)]
        cells += [get(r) for _, get in columns]
        cells += [name, _f(r.get("unit_ms", r.get("gemm_ms")), ".2f"), _f(r.get("fwd_units"))]
        cells += [_f(r.get("fwd_bwd_units")), _f(r.get("fwd_bwd_ms"), ".1f")]
        cells += ["-" if mem is None else format(mem / GiB, ".3g")]
        cells += [_err(r, k) for k in ("log_probs", "entropy", "grad_hidden", "grad_weight")]
        cells += [_err(r, "loss")] if losses else []
        lines.append("| " + " | ".join(cells) + " |")
    unsteady = [(r, why) for r in ok if (why := _unsteady(r))]
    if unsteady:
        lines += [
            "",
            f"Unsteady GEMM unit (its slowest paired run over {UNSTEADY_SPREAD:g}x its fastest, or "
            f"its paired runs' median {UNSTEADY_SPREAD:g}x away from the GEMM timed alone before "
            "the case: other load on the machine, or a GEMM too small to time; or one run alone, "
            "whose steadiness is unknown): compare these rows in ms, not in units:",
            "",
        ]
        for r, why in unsteady:
            c = r["case"]
            lines.append(
                f"- N={c['n']} H={c['hidden']} V={c['vocab']} {c['dtype']} "
                f"{_with_head(r['impl'], c)}{_where(r, columns)}: {why}"
            )
    skipped = [r for r in records if r["status"] != "ok"]
    if skipped:
        where = _settings(records, reference=False)
        lines += ["", "Not measured:", ""]
        for r in skipped:
            c = r["case"]
            why = r.get("reason") or r.get("error") or ""
            lines.append(
                f"- N={c['n']} H={c['hidden']} V={c['vocab']} {c['dtype']} "
                f"{_with_head(r['impl'], c)}{_where(r, where)}: {r['status']}: {why}"
            )
    return "\n".join(lines) + "\n"


def plot(
    records: Iterable[dict[str, Any]],
    path: str | os.PathLike[str],
    *,
    fmt: str | None = None,
    flag: str = "--plot",
) -> bool:
    """PNG of fwd+bwd (solid) and fwd (dashed) GEMM units and peak extra memory against N.

    One row of two panels per device, H, V, dtype, weight scale, temperature and seed, one line
    per implementation and case at one setting (``plot_series``: results that ``--append`` added
    at the same setting extend a line, a case measured again is drawn from its latest result,
    other versions or environments are lines of their own). Returns False (with a message) when
    matplotlib is missing. ``fmt`` is the file's format (default: ``path``'s extension), written
    to ``path`` itself; a failed write is an OSError naming ``flag``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from fusedhead.install_hints import extra_command

        print(
            f"fusedhead bench: matplotlib is not installed, no plot ({extra_command('bench')})",
            file=sys.stderr,
        )
        return False
    records = list(records)
    groups = plot_series(records)
    # Single-N panels (accuracy-only extras such as a peaked case) only clutter a plot against N.
    multi = {
        k: v
        for k, v in groups.items()
        if len({r["case"]["n"] for recs in v.values() for r in recs}) > 1
    }
    groups = multi or groups
    panels = sorted(groups, key=_panel_order)
    several = [len({p[i] for p in panels}) > 1 for i in range(len(panels[0]))] if panels else []
    rows = max(1, len(groups))
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.2 * rows), squeeze=False)
    colors: dict[str, Any] = {}
    palette = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    for row, panel in enumerate(panels):
        device, hid, voc, dtype, scale, temperature, seed = panel
        several_devices, several_seeds = several[0], several[6]  # named where they differ
        lines = groups[panel]
        ax_t, ax_m = axes[row]
        for name, pts in lines.items():
            color = colors.setdefault(name, palette[len(colors) % len(palette)])
            ns = [r["case"]["n"] for r in pts]
            fb = [r.get("fwd_bwd_units") for r in pts]
            fw = [r.get("fwd_units") for r in pts]
            mem = [
                None if r.get("peak_extra_bytes") is None else r["peak_extra_bytes"] / GiB
                for r in pts
            ]
            ax_t.plot(ns, fb, marker="o", color=color, label=f"{name} fwd+bwd")
            ax_t.plot(ns, fw, marker="x", linestyle="--", color=color, label=f"{name} fwd")
            if any(m is not None for m in mem):
                ax_m.plot(ns, mem, marker="o", color=color, label=name)
        title = f"H={hid}, V={voc}, {_dtype_scale({'dtype': dtype, 'scale': scale})}"
        title += "" if temperature is None else f", T={temperature:g}"
        title += f", seed {seed}" if several_seeds else ""
        title += f", {device}" if several_devices else ""
        ax_t.set(
            xscale="log", xlabel="N (tokens)", ylabel="time (GEMM units)", title=f"time, {title}"
        )
        ax_m.set(
            xscale="log",
            xlabel="N (tokens)",
            ylabel="peak extra memory (GiB)",
            title=f"memory, {title}",
        )
        ticks = sorted({r["case"]["n"] for recs in lines.values() for r in recs})
        for ax in (ax_t, ax_m):
            ax.grid(True, which="both", alpha=0.3)
            ax.set_ylim(bottom=0)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
        top = max((y for line in ax_t.lines for y in line.get_ydata() if y is not None), default=1)
        ax_t.set_ylim(0, 1.45 * float(top))  # room for the legend above the lines
        ax_t.legend(fontsize=7, ncol=3, loc="upper center")
        if ax_m.lines:
            ax_m.legend(fontsize=7)
    if not groups:
        axes[0][0].text(0.5, 0.5, "no measured cases", ha="center")
    ok = [r for r in records if r["status"] == "ok"]
    if ok:
        devices = " / ".join(_distinct(str((r.get("device") or {}).get("name", "")) for r in ok))
        days = sorted({str(r.get("date") or "")[:10] for r in ok} - {""})
        when = "" if not days else days[0] if days[0] == days[-1] else f"{days[0]} to {days[-1]}"
        fig.suptitle(f"fusedhead bench on {devices}, {when}", fontsize=10)
    fig.tight_layout()
    image = io.BytesIO()
    try:
        fig.savefig(image, dpi=110, format=fmt or Path(path).suffix.lstrip(".").lower() or None)
    finally:
        plt.close(fig)
    write_file(Path(path), image.getvalue(), flag)
    return True
