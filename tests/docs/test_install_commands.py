"""Before the first PyPI release no page may tell a stranger to pip-install a backend extra bare.

``pip install 'fusedhead[triton]'`` finds nothing on PyPI until fusedhead is published; the docs
then say how to install from a clone (``./plugins/triton_backend``) or from built wheels
(``--find-links dist``). A command transcript's output lines (a backend's own message) are not
advice the page gives, so only the ``$`` lines of a ``console`` block count.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fusedhead import install_hints

ROOT = Path(__file__).resolve().parents[2]
#: The pages a user reads; docs/releasing.md describes the release itself and is left out.
PAGES = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("**/*.md") if p.name != "releasing.md"),
    ROOT / "examples" / "third_party_backend" / "README.md",
]
#: Extras that pull a backend distribution, which only PyPI or a --find-links folder can provide.
BACKEND_EXTRAS = {"torch", "triton", "liger", "liger-sm90", "all"}
BARE = re.compile(
    r"pip install (?P<flags>(?:-\S+ (?:\S+ )?)*)['\"]?fusedhead\[(?P<extras>[^\]]+)\]"
)
CONSOLE = re.compile(r"```console\n(.*?)```", re.S)


def advice(text: str) -> str:
    """The page without the output lines of its console transcripts."""

    def commands_only(m: re.Match[str]) -> str:
        kept = [line for line in m.group(1).splitlines() if line.startswith("$ ")]
        return "```console\n" + "\n".join(kept) + "\n```"

    return CONSOLE.sub(commands_only, text)


def bare_backend_installs(text: str) -> list[str]:
    """Paragraphs advising ``pip install 'fusedhead[BACKEND]'`` without wheels or a PyPI caveat."""
    found = []
    for paragraph in re.split(r"\n\s*\n", advice(text)):
        for m in BARE.finditer(paragraph):
            extras = {e.strip() for e in m.group("extras").split(",")}
            if not extras & BACKEND_EXTRAS or "--find-links" in m.group("flags"):
                continue
            if "PyPI" in paragraph:  # "not on PyPI yet ...", "once it is on PyPI"
                continue
            found.append(m.group(0))
    return found


def test_the_checker_catches_a_bare_backend_install() -> None:
    """The rule itself: a bare backend extra is caught, the wheel form and a caveat are not."""
    assert bare_backend_installs("Install: `pip install 'fusedhead[triton]'`.") == [
        "pip install 'fusedhead[triton]"
    ]
    assert not bare_backend_installs("`pip install --find-links dist 'fusedhead[torch]'`")
    assert not bare_backend_installs("`pip install 'fusedhead[torch]'` once it is on PyPI")
    assert not bare_backend_installs("`pip install 'fusedhead[testing]' .`")
    shown = '```console\n$ fusedhead list\nFix: pip install "fusedhead[liger-sm90]"\n```'
    assert not bare_backend_installs(shown)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_advises_a_backend_extra_that_pypi_lacks(page: Path) -> None:
    if install_hints.ON_PYPI:
        pytest.skip("fusedhead is on PyPI: the extras install from there")
    bare = bare_backend_installs(page.read_text())
    assert not bare, (
        f"{page.relative_to(ROOT)} advises {bare}, which finds nothing before the first PyPI "
        "release: say how to install from a clone (./plugins/NAME_backend) or the built wheels "
        "(--find-links dist)"
    )
