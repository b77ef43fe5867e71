"""Every Python block in the README and docs/ runs, as a reader would paste it.

A block preceded by ``<!-- docs-test: gpu -->`` needs CUDA and runs only where a GPU is present; one
preceded by ``<!-- docs-test: needs MODULE (how to get it) -->`` runs wherever MODULE imports (a
trainer: CI installs them); one preceded by ``<!-- docs-test: skip (reason) -->`` is shown but not
run, with the reason.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "core" / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK = re.compile(
    r"(?:<!--\s*docs-test:\s*(?P<mark>[^>]*?)\s*-->\s*\n)?```python\n(?P<code>.*?)```", re.S
)


def blocks() -> list[object]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for i, m in enumerate(BLOCK.finditer(text)):
            line = text[: m.start("code")].count("\n") + 1
            mark = (m.group("mark") or "").strip()
            marks = []
            if mark.startswith("gpu"):
                marks.append(pytest.mark.gpu)
            elif mark.startswith("skip"):
                marks.append(pytest.mark.skip(reason=f"marked in the doc: {mark}"))
            elif not mark.startswith("needs ") and mark:
                raise ValueError(f"{path}: unknown docs-test mark {mark!r} (gpu, skip, needs)")
            rel = path.relative_to(ROOT)
            found.append(
                pytest.param(path, m.group("code"), mark, id=f"{rel}:{line}#{i}", marks=marks)
            )
    return found


#: ``print(...)  # COMMENT``: the comment is what the reader is told the line prints.
PRINTED = re.compile(r"^\s*print\(.*\)\s+#\s*(?P<comment>.+)$", re.M)
SIZE = re.compile(r"torch\.Size\(\[[\d, ]*\]\)")


def promised_output(code: str) -> list[str]:
    """Fragments a block's print comments promise its output holds.

    A comment quoting a message with elisions (``# ... Did you mean 'torch'? ...``) promises each
    piece between the ``...``; one that starts with a ``torch.Size`` promises that size. Other
    comments are prose (``# the gathered gradient``) and promise nothing checkable.
    """
    fragments: list[str] = []
    for m in PRINTED.finditer(code):
        comment = m.group("comment").strip()
        if "..." in comment:
            fragments += [part.strip() for part in comment.split("...") if part.strip()]
        elif size := SIZE.match(comment):
            fragments.append(size.group(0))
    return fragments


def test_promised_output_reads_quotes_and_sizes() -> None:
    """The comment reader itself: quotes and sizes are read, prose is not."""
    code = (
        "print(exc)  # ... Did you mean 'torch'? ...\n"
        "print(x.shape)  # torch.Size([4, 16]) twice, fp32\n"
        "print(g.shape)  # the gathered gradient\n"
    )
    assert promised_output(code) == ["Did you mean 'torch'?", "torch.Size([4, 16])"]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "code", "mark"), blocks())
def test_doc_block_runs(path: Path, code: str, mark: str, tmp_path: Path) -> None:
    if mark.startswith("needs "):  # needs MODULE (how to get it): run wherever it imports
        module = mark.split()[1]
        pytest.importorskip(module, reason=f"marked in the doc: {mark}")
    if mark.startswith("gpu"):
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip(
                "block needs a CUDA device (run with pytest -m gpu on a GPU before release)"
            )
    script = tmp_path / "block.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (
        f"{path.name} block failed:\n{code}\n--- stderr ---\n{proc.stderr[-4000:]}"
    )
    missing = [f for f in promised_output(code) if f not in proc.stdout]
    assert not missing, (
        f"{path.name} block's comments promise output it does not print: {missing}\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}"
    )


def test_install_advice_matches_whether_fusedhead_is_on_pypi() -> None:
    """The errors advise `pip install 'fusedhead[NAME]'` only once the README says it is on PyPI."""
    from fusedhead import install_hints

    not_yet = "There is no release on PyPI yet" in (ROOT / "README.md").read_text()
    assert install_hints.ON_PYPI is not not_yet, (
        "README.md and install_hints.ON_PYPI disagree on whether fusedhead is on PyPI "
        "(docs/releasing.md, step 6, changes both)"
    )
    advice = install_hints.install_command("triton")
    assert (advice == "pip install 'fusedhead[triton]'") is install_hints.ON_PYPI, advice


#: The four published distributions' projects; each one's README is its page on PyPI.
PUBLISHED = ["core", "plugins/torch_backend", "plugins/triton_backend", "plugins/liger_backend"]


@pytest.mark.parametrize("project", PUBLISHED)
def test_a_distribution_readme_stands_on_its_own(project: str) -> None:
    """On PyPI a README has no repository around it: a relative link leads nowhere there.

    And the core's page is what a stranger reads first: it says how to install and call it.
    """
    readme = ROOT / project / "README.md"
    assert 'readme = "README.md"' in (ROOT / project / "pyproject.toml").read_text()
    text = readme.read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [t for t in targets if not t.startswith(("http://", "https://", "#"))]
    assert not relative, f"{project}/README.md links to {relative}, dead on PyPI"
    if project == "core":
        assert "pip install" in text and "fused_head(" in text and len(text.splitlines()) > 20
