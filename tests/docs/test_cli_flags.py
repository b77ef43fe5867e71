"""Every ``fusedhead SUBCOMMAND --flag`` a page shows is a flag that sub-command takes.

The pages quote the CLI in prose, shell blocks and transcripts; a renamed or dropped flag would
leave them telling users to type what argparse refuses. The flags are read from the parser itself.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from fusedhead.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("**/*.md")),
    ROOT / "examples" / "third_party_backend" / "README.md",
]
COMMAND = re.compile(r"\bfusedhead (list|info|check|bench|demo)\b([^`#;|\n]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-z])\b")


def subcommand_flags() -> dict[str, set[str]]:
    """Each sub-command's option strings, from the CLI's own parser."""
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: {s for action in p._actions for s in action.option_strings}
        for name, p in subs.choices.items()
    }


def shown_flags(text: str) -> list[tuple[str, str]]:
    """(sub-command, flag) pairs a page shows, shell line continuations joined."""
    text = text.replace("\\\n", " ")
    return [(m.group(1), f) for m in COMMAND.finditer(text) for f in FLAG.findall(m.group(2))]


def test_shown_flags_reads_commands() -> None:
    """The reader itself: flags after a sub-command, up to the end of the code span or comment."""
    text = "run `fusedhead check NAME --device cuda -k topk` then\n$ fusedhead list --check \\\n  --json # --nope"
    assert shown_flags(text) == [
        ("check", "--device"),
        ("check", "-k"),
        ("list", "--check"),
        ("list", "--json"),
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cli_flag_on_the_page_exists(page: Path) -> None:
    flags = subcommand_flags()
    unknown = sorted({(cmd, f) for cmd, f in shown_flags(page.read_text()) if f not in flags[cmd]})
    assert not unknown, f"{page.relative_to(ROOT)} shows flags the CLI does not take: {unknown}"
