"""The example backend's README, the guide for outside authors, names what the kit and API have.

Its kit transcript, its table of properties and its table of capabilities were written by hand;
these tests fail when the kit gains a property or ``Capabilities`` a field the README does not show.
"""

from __future__ import annotations

import re
from pathlib import Path

from fusedhead.protocol import Capabilities
from fusedhead.testing import PROPERTIES

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "examples" / "third_party_backend" / "README.md").read_text()


def section(title: str) -> str:
    """The README's text from the heading ``title`` to the next heading of any level."""
    m = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ |\Z)", README, re.S | re.M)
    assert m, f"examples/third_party_backend/README.md has no section {title!r}"
    return m.group(1)


def first_column(table_text: str) -> set[str]:
    """Backticked names in the first column of a Markdown table's rows."""
    names: set[str] = set()
    for line in table_text.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([a-z0-9_]+)`", line.split("|")[1]))
    return names


def test_kit_transcript_counts_every_property() -> None:
    """The ``fusedhead check example-bi`` transcript's header and totals match the kit's size."""
    header = re.search(r"example-bi on cpu fp32, (\d+) properties", README)
    totals = re.search(r"example-bi on cpu fp32: (\d+) pass, (\d+) fail, (\d+) not run", README)
    assert header and totals, "the README lost its `fusedhead check example-bi` transcript"
    assert int(header.group(1)) == len(PROPERTIES), (
        f"the transcript says {header.group(1)} properties; the kit has {len(PROPERTIES)}"
    )
    assert sum(int(n) for n in totals.groups()) == len(PROPERTIES), totals.group(0)


def test_kit_table_lists_exactly_the_kits_properties() -> None:
    shown = first_column(section("What the kit checks"))
    assert shown == set(PROPERTIES), (
        f"missing from the README: {sorted(set(PROPERTIES) - shown)}; "
        f"not in the kit: {sorted(shown - set(PROPERTIES))}"
    )


def test_capabilities_table_names_every_field() -> None:
    shown = first_column(section("Capabilities"))
    fields = set(Capabilities.model_fields)
    assert fields <= shown, f"Capabilities fields missing from the README: {sorted(fields - shown)}"
    assert shown <= fields, f"not Capabilities fields: {sorted(shown - fields)}"
