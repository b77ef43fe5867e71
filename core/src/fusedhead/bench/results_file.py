"""The results file: a JSON list written whole after every measurement, and the atomic write that
every output of the bench (JSON, table, plot) goes through."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import torch


class JsonWriter:
    """A JSON list on disk that grows by one object per measurement, valid after each write.

    Each write is ``write_file``'s: the whole list, renamed over ``path`` (through a symlink,
    its target); ``flag`` names the path in a write's error."""

    def __init__(
        self, path: str | os.PathLike[str] | None, *, append: bool = False, flag: str = "--json"
    ) -> None:
        self.path = Path(path) if path else None
        self.flag = flag
        self.records: list[dict[str, Any]] = []
        if self.path is not None and append and self.path.exists():
            loaded = json.loads(self.path.read_text() or "[]")
            if not isinstance(loaded, list):
                raise ValueError(f"--append: {self.path} does not hold a JSON list")
            self.records = loaded
        if self.path is not None:
            self._flush()

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._flush()

    def _flush(self) -> None:
        if self.path is None:
            return
        text = json.dumps(self.records, indent=1, default=_json_default, allow_nan=True) + "\n"
        write_file(self.path, text, self.flag)


def write_file(path: Path, data: str | bytes, flag: str) -> None:
    """Write ``data`` to the regular file ``path`` (its folder made if needed) atomically: into a
    new file of its own beside it, then renamed over ``path``, so the file is whole at any
    moment. Text is UTF-8 (a character it cannot hold, a lone surrogate, written as its ``\\u``
    escape). A failure (a full disk, a folder that became read-only) is an OSError naming
    ``flag`` and the path, the temporary file removed.

    A symlink is followed: its target is the file written, the link kept. Anything else that is
    not a regular file (a device such as /dev/null, a pipe) is refused, never replaced."""
    try:
        target = path.resolve()
        if target.exists() and not target.is_file():
            raise OSError(f"{file_kind(target)}, not a regular file")
        target.parent.mkdir(parents=True, exist_ok=True)
        for i in itertools.count():  # a name no other file has: O_EXCL, never an existing one
            tmp = target.with_name(f".{target.name}.{os.getpid()}.{i}.tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                break
            except FileExistsError:
                continue
        try:
            raw = data if isinstance(data, bytes) else data.encode("utf-8", "backslashreplace")
            with os.fdopen(fd, "wb") as f:
                _write_all(f, raw)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        why = getattr(exc, "strerror", None) or exc
        raise OSError(f"{flag} {path}: could not be written ({why})") from exc


def file_kind(path: Path) -> str:
    """What the existing ``path`` (not a regular file) is, in words."""
    import stat

    mode = path.stat().st_mode
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a special file"


def _write_all(f: Any, data: bytes) -> None:
    """``f.write(data)`` and its flush (a full disk shows here); apart for the tests to fail."""
    f.write(data)
    f.flush()


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
