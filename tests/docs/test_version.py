"""The version lives in one place per distribution, and the first-party ones move in lockstep.

Each distribution's version is its package's ``__version__`` (hatch reads it: ``[tool.hatch.version]``);
nothing else in the tree may type it. These tests build each distribution's metadata with hatchling,
compare it with that source, check the compatible ranges the distributions pin on each other, and
grep the tree for the version string (docs/releasing.md says how to bump it).
"""

from __future__ import annotations

import email
import re
import subprocess
import sys
import tempfile
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from dist_layout import DISTS
from dist_layout import REPO as ROOT
from packaging.requirements import Requirement
from packaging.version import Version

FIRST_PARTY = ["fusedhead", "fusedhead-torch", "fusedhead-triton", "fusedhead-liger"]
VERSION_LINE = re.compile(r'^__version__ = "([^"]+)"', re.M)


def source_file(dist: str) -> Path:
    project, package = DISTS[dist]
    return ROOT / project / "src" / package / "__init__.py"


def source_version(dist: str) -> str:
    """The one place the distribution's version is written."""
    found = VERSION_LINE.findall(source_file(dist).read_text())
    assert len(found) == 1, f"{source_file(dist)}: expected one __version__ line, found {found}"
    return found[0]


VERSION = source_version("fusedhead")


@cache
def built_metadata(dist: str) -> email.message.Message:
    """Core metadata as hatchling builds it for the wheel (what pip and PyPI would see)."""
    code = (
        "import sys; from hatchling.build import prepare_metadata_for_build_wheel as p; "
        "print(p(sys.argv[1]))"
    )
    with tempfile.TemporaryDirectory(prefix=f"{dist}-metadata-") as tmp:
        proc = subprocess.run(
            [sys.executable, "-c", code, tmp],
            cwd=ROOT / DISTS[dist][0],
            capture_output=True,
            text=True,
            check=True,
        )
        info = Path(tmp) / proc.stdout.strip().splitlines()[-1] / "METADATA"
        return email.message_from_string(info.read_text())


def pyproject(dist: str) -> dict:
    return tomllib.loads((ROOT / DISTS[dist][0] / "pyproject.toml").read_text())


def compatible(spec: Requirement, version: str) -> None:
    """A pin on a sibling distribution takes this version and stops before the next major."""
    v = Version(version)
    assert spec.specifier.contains(v), f"{spec} excludes {version}"
    assert not spec.specifier.contains(Version(f"{v.major + 1}.0")), f"{spec} admits the next major"
    assert spec.specifier.contains(Version(f"{v.major}.{v.minor + 7}")), (
        f"{spec} is pinned too tightly"
    )


@pytest.mark.parametrize("dist", list(DISTS))
def test_metadata_version_is_the_package_version(dist: str) -> None:
    project = pyproject(dist)
    assert "version" not in project["project"], f"{dist}: a static version; use dynamic"
    assert "version" in project["project"].get("dynamic", []), f"{dist}: version not dynamic"
    path = project["tool"]["hatch"]["version"]["path"]
    assert ROOT / DISTS[dist][0] / path == source_file(dist)
    assert built_metadata(dist)["Version"] == source_version(dist)


def test_first_party_distributions_share_one_version() -> None:
    assert {d: source_version(d) for d in FIRST_PARTY} == dict.fromkeys(FIRST_PARTY, VERSION)
    Version(VERSION)  # a valid PEP 440 version


@pytest.mark.parametrize("dist", [d for d in DISTS if d != "fusedhead"])
def test_backends_pin_a_compatible_core(dist: str) -> None:
    core = [
        Requirement(r)
        for r in built_metadata(dist).get_all("Requires-Dist")
        if Requirement(r).name == "fusedhead"
    ]
    assert core, f"{dist} does not depend on fusedhead"
    for req in core:
        compatible(req, VERSION)


def test_core_extras_pin_compatible_backends_and_keep_cpu_installs_light() -> None:
    extras: dict[str, list[Requirement]] = {}
    for raw in built_metadata("fusedhead").get_all("Requires-Dist"):
        req = Requirement(raw)
        marker = str(req.marker or "")
        extra = re.search(r'extra == "([^"]+)"', marker)
        if extra and req.name.startswith("fusedhead-"):
            extras.setdefault(extra.group(1), []).append(req)
    names = {e: {r.name for r in reqs} for e, reqs in extras.items()}
    assert names == {
        "torch": {"fusedhead-torch"},
        "triton": {"fusedhead-triton"},
        "liger": {"fusedhead-liger"},
        "liger-sm90": {"fusedhead-liger"},
        "all": {"fusedhead-torch", "fusedhead-triton", "fusedhead-liger"},
    }
    for reqs in extras.values():
        for req in reqs:
            compatible(req, VERSION)
    # The CuTe DSL (Liger's SM90 kernel) only where asked for by name.
    heavy = {e for e, reqs in extras.items() for r in reqs if "sm90" in r.extras}
    assert heavy == {"liger-sm90"}


@pytest.mark.parametrize(
    "dist", [d for d in FIRST_PARTY if d in {m.metadata["Name"] for m in metadata.distributions()}]
)
def test_installed_metadata_matches_the_source(dist: str) -> None:
    installed = metadata.version(dist)
    assert installed == source_version(dist), (
        f"{dist} is installed as {installed} but its source says {source_version(dist)}: "
        "re-run bash scripts/setup.sh (editable installs freeze their metadata)"
    )


def test_dunder_version_is_the_source() -> None:
    import fusedhead

    assert fusedhead.__version__ == VERSION


@pytest.mark.parametrize("dist", list(DISTS))
def test_license_and_py_typed_ship(dist: str) -> None:
    project, package = DISTS[dist]
    assert (ROOT / project / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert built_metadata(dist).get_all("License-File") == ["LICENSE"]
    assert built_metadata(dist)["License-Expression"] == "Apache-2.0"
    assert (ROOT / project / "src" / package / "py.typed").is_file()


def tree_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [ROOT / p for p in out.split("\0") if p and (ROOT / p).is_file()]


CONSOLE = re.compile(r"```console\n(.*?)```", re.S)
DIST_VERSION = re.compile(
    r"\b(fusedhead(?:-torch|-triton|-liger|-example-batchinvariant)?)\b"
    r"(?: \(core\))?,?\s+(\d+\.\d+\.\d+\S*)"
)


def test_no_other_file_types_the_version() -> None:
    """Only the sources, the changelog and pasted output (checked below) may name it."""
    allowed = {source_file(d) for d in DISTS} | {ROOT / "CHANGELOG.md"}
    needle = re.compile(rf"(?<![\w.]){re.escape(VERSION)}(?![\w.])")
    offenders = []
    for path in tree_files():
        if path in allowed:
            continue
        if path.parent == ROOT / "docs" / "bench" and path.suffix in (".json", ".log"):
            continue  # a machine's raw record: the versions that run measured, never edited
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if path.name == "pyproject.toml":
            name = tomllib.loads(text).get("project", {}).get("name")
            if name not in DISTS:
                continue  # a test fixture standing in for a third party: its own version
        if path.suffix == ".md":
            text = CONSOLE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if not needle.search(line):
                continue
            near = "\n".join(lines[max(0, i - 3) : i + 4])
            if re.search(r"fh[-_](fixture|fault)", near):
                continue  # a test about the fixture distributions, which carry their own version
            offenders.append(f"{path.relative_to(ROOT)}:{i + 1}: {line.strip()}")
    assert not offenders, (
        f"the version {VERSION} is typed outside its sources (read fusedhead.__version__ or "
        "importlib.metadata instead):\n" + "\n".join(offenders)
    )


def test_pasted_transcripts_show_the_current_versions() -> None:
    stale = []
    for path in [
        ROOT / "README.md",
        *sorted(ROOT.glob("docs/*.md")),
        *sorted(ROOT.glob("*/*/README.md")),
    ]:
        for block in CONSOLE.findall(path.read_text()):
            for dist, version in DIST_VERSION.findall(block):
                if version != source_version(dist):
                    stale.append(f"{path.relative_to(ROOT)}: {dist} {version}")
    assert not stale, "transcripts to re-run and paste again:\n" + "\n".join(stale)


def test_changelog_has_this_release() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(VERSION)}\]", text, re.M), f"no ## [{VERSION}] section"
