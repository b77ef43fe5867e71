"""scripts/gpu/setup_tree.sh and the GPU scripts' exit statuses, on the CPU with stubs.

Every GPU script installs this tree through setup_tree.sh: from a carried ``.gpu-wheels`` where
there is one (the lent machine has no package index), else from pip's index with the machine's
torch held; then it checks that the fusedhead that imports is this tree's. A failed install stops
the script with a non-zero status (before, it was buried in setup.log and the script went on to
measure whatever fusedhead was installed, exiting 0), and a failed step makes the script exit
non-zero at its end.

``python3`` is stubbed on PATH: ``-m pip`` records its arguments (and the constraints file it is
given) and exits with $STUB_PIP_RC; the measuring commands (``-m fusedhead.cli``, ``-m pytest``,
the scripts' own Python files) exit 4 or 7 at once; everything else is this interpreter.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

#: The version the fake installs carry: the tree's own.
VERSION = importlib.metadata.version("fusedhead")

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "gpu"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or not sys.platform.startswith("linux"),
    reason="needs bash on Linux",
)

PYTHON_STUB = r"""#!/usr/bin/env bash
log=${STUB_LOG:-/dev/null}
if [[ ${1:-} == -m ]]; then
  case ${2:-} in
  pip)
    echo "pip ${*:3}" >>"$log"
    for a in "$@"; do
      [[ $a == *constraints.txt && -f $a ]] && sed 's/^/constraint /' "$a" >>"$log"
    done
    echo "stub pip: exit ${STUB_PIP_RC:-0}"
    exit "${STUB_PIP_RC:-0}"
    ;;
  fusedhead.cli | pytest | torch.distributed.run)
    echo "stub: python3 $*"
    exit 4
    ;;
  esac
fi
case ${1:-} in
*/tree_installed.py | */pack_out.py) ;;
*/env_report.py)
  echo "stub env report"
  exit 0
  ;;
*.py)
  echo "stub: python3 $*"
  exit 7
  ;;
esac
exec PYTHON "$@"
"""


def _env(tmp_path: Path, *, pip_rc: int = 0, wheels: Path | None = None) -> dict[str, str]:
    """PATH with the stubs first; WHEELS a folder without install-wheels unless given."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "python3").write_text(PYTHON_STUB.replace("PYTHON", sys.executable))
    for tool in ("nvidia-smi", "torchrun", "compute-sanitizer", "ncu"):
        (bindir / tool).write_text(f"#!/usr/bin/env bash\necho 'stub {tool}'\nexit 4\n")
    (bindir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'GPU 0: stub'\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH", "SETUP_PYTHON")}
    env.update(
        PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
        STUB_LOG=str(tmp_path / "stub.log"),
        STUB_PIP_RC=str(pip_rc),
        WHEELS=str(wheels or tmp_path / "no-wheels"),
        AB_DIR=str(tmp_path / "no-packs"),
    )
    return env


def _bash(*args: str, env: dict[str, str], timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _stub_log(tmp_path: Path) -> list[str]:
    log = tmp_path / "stub.log"
    return log.read_text().splitlines() if log.exists() else []


def _wheels(tmp_path: Path, *, fail_with_parts: bool = False, fail: bool = False) -> Path:
    """A stand-in for the git-ignored .gpu-wheels: install-wheels records its arguments."""
    wheels = tmp_path / "wheels"
    (wheels / "small").mkdir(parents=True)
    (wheels / "install-wheels").write_text(
        "#!/usr/bin/env bash\n"
        'echo "install-wheels $#: $*" >>"$STUB_LOG"\n'
        + ("exit 1\n" if fail else "")
        + ("(($# > 1)) && exit 1\n" if fail_with_parts else "")
        + "exit 0\n"
    )
    return wheels


@pytest.fixture(scope="module")
def tree_is_installed() -> None:
    """The checks that pass need this checkout's fusedhead installed (editable, as setup.sh does)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "tree_installed.py"), str(ROOT)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"this checkout's fusedhead is not what imports here: {proc.stderr}")


def test_without_carried_wheels_setup_installs_from_the_index_keeping_torch(
    tmp_path: Path, tree_is_installed: None
) -> None:
    import importlib.metadata as md

    log = tmp_path / "setup.log"
    proc = _bash(str(SCRIPTS / "setup_tree.sh"), str(log), "--liger", "--trl", env=_env(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr + log.read_text()
    calls = _stub_log(tmp_path)
    pips = [c for c in calls if c.startswith("pip ")]
    assert len(pips) == 2, calls
    project, trl = pips
    assert "--no-index" not in project and "--no-deps" not in project
    assert project.endswith(
        "./core[testing,bench] ./plugins/torch_backend ./plugins/triton_backend"
        " ./plugins/liger_backend[sm90]"
    ), project
    assert " -c " in project  # the constraints file, whose lines follow in the log
    assert f"constraint torch=={md.version('torch')}" in calls
    assert trl == "pip install -q --no-deps trl==1.16.0"
    text = log.read_text()
    assert "installing from pip's index" in text
    assert "from this tree's core" in text
    assert not any(c.startswith("install-wheels") for c in calls)


def test_with_carried_wheels_setup_installs_without_an_index(
    tmp_path: Path, tree_is_installed: None
) -> None:
    parts = tmp_path / "parts"
    parts.mkdir()
    whl = tmp_path / "demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("demo_pkg/__init__.py", "x = 1\n")
    data = whl.read_bytes()
    half = len(data) // 2
    (parts / f"{whl.name}.part-aa").write_bytes(data[:half])
    (parts / f"{whl.name}.part-ab").write_bytes(data[half:])
    wheels = _wheels(tmp_path, fail_with_parts=True)
    log = tmp_path / "setup.log"
    proc = _bash(
        str(SCRIPTS / "setup_tree.sh"), str(log), "--liger", str(parts),
        env=_env(tmp_path, wheels=wheels),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr + log.read_text()
    calls = _stub_log(tmp_path)
    # With the pieces first; that failing, again without them.
    assert [c.split(":")[0] for c in calls if c.startswith("install-wheels")] == [
        "install-wheels 2",
        "install-wheels 1",
    ]
    assert "retrying the wheels without the CuTe DSL pieces" in log.read_text()
    (pip,) = [c for c in calls if c.startswith("pip ")]
    assert pip == (
        "pip install -q --no-index --no-deps --no-build-isolation ./core"
        " ./plugins/torch_backend ./plugins/triton_backend ./plugins/liger_backend"
    )


@pytest.mark.parametrize("how", ["pip", "install-wheels"])
def test_a_failed_install_is_a_failure_with_its_reason(tmp_path: Path, how: str) -> None:
    wheels = _wheels(tmp_path, fail=True) if how == "install-wheels" else None
    log = tmp_path / "setup.log"
    proc = _bash(
        str(SCRIPTS / "setup_tree.sh"), str(log), env=_env(tmp_path, pip_rc=1, wheels=wheels)
    )
    assert proc.returncode == 1
    assert "setup_tree: FAILED" in proc.stderr
    assert ("install-wheels" if how == "install-wheels" else "pip install") in proc.stderr
    assert "last lines of the setup log" in proc.stderr  # the log's tail, not only "failed"


def test_an_installed_fusedhead_of_another_tree_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other-tree"
    for sub in ("core", "plugins/torch_backend", "plugins/triton_backend"):
        (other / sub).mkdir(parents=True)
    log = tmp_path / "setup.log"
    proc = _bash(str(SCRIPTS / "setup_tree.sh"), str(log), "--tree", str(other), env=_env(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "not this tree's install" in proc.stderr
    assert "not from this tree's core" in log.read_text() or "import fusedhead" in log.read_text()


def _fake_site(site: Path, tree: Path) -> None:
    """This tree's three packages installed (not editable) from ``tree`` into ``site``."""
    for module, dist, sub in (
        ("fusedhead", "fusedhead", "core"),
        ("fusedhead_torch", "fusedhead_torch", "plugins/torch_backend"),
        ("fusedhead_triton", "fusedhead_triton", "plugins/triton_backend"),
    ):
        shutil.copytree(
            ROOT / sub / "src" / module, site / module,
            ignore=shutil.ignore_patterns("__pycache__"),
        )  # fmt: skip
        info = site / f"{dist}-{VERSION}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {VERSION}\n"
        )
        files = [p.relative_to(site).as_posix() for p in (site / module).rglob("*.py")]
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
        url = (tree / sub).resolve().as_uri()
        (info / "direct_url.json").write_text(json.dumps({"url": url, "dir_info": {}}))


def test_tree_installed_reads_the_files_of_an_install_from_the_same_folder(tmp_path: Path) -> None:
    """An install made by an earlier call from this same folder is not this tree's today."""
    pytest.importorskip("torch")
    site = tmp_path / "site"
    _fake_site(site, ROOT)
    env = {**os.environ, "PYTHONPATH": str(site)}
    check = [sys.executable, str(SCRIPTS / "tree_installed.py"), str(ROOT)]
    proc = subprocess.run(check, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("its files the tree's") == 3
    cli = site / "fusedhead" / "cli.py"
    cli.write_text(cli.read_text() + "\n# an older tree\n")
    proc = subprocess.run(check, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "fusedhead/cli.py" in proc.stderr and "earlier install" in proc.stderr


# Every script that installs, with its arguments: none may go on to measure after a failed install.
INSTALLING = [
    ("run_all.sh", ["--out", "{out}"]),
    ("torch_head.sh", ["{out}"]),
    ("policy_loss.sh", ["{out}"]),
    ("final_check.sh", ["{out}"]),
    ("policy_shapes.sh", ["{out}"]),
    ("sanitize.sh", ["{out}"]),
    ("two_gpu.sh", ["{out}"]),
    ("issue32.sh", ["{out}"]),
    ("issue35.sh", ["{out}"]),
    ("issues_33_34.sh", ["{out}"]),
    ("trainers_outputs.sh", ["{out}"]),
    ("triton_outputs.sh", ["bench", "{out}"]),
    ("triton_v2.sh", ["stash", "{out}"]),
    ("policy_one_call.sh", ["{out}"]),
]
# What a script may leave in OUT when its install failed: the install's log, run_all's summary,
# and policy_one_call's steps before its reinstall.
SETUP_ONLY = {"setup.log", "summary.txt", "sanity.log", "ab.log", "ab", "reinstall.log"}


def test_every_installing_script_is_listed() -> None:
    sourcing = {
        p.name for p in SCRIPTS.glob("*.sh") if "setup_tree.sh" in p.read_text() and
        p.name != "setup_tree.sh"
    }  # fmt: skip
    assert sourcing <= {name for name, _ in INSTALLING} | {"ab.sh", "stash_part.sh"}, sourcing


@pytest.mark.parametrize(("script", "args"), INSTALLING, ids=[s for s, _ in INSTALLING])
def test_a_script_whose_install_fails_exits_non_zero_and_measures_nothing(
    tmp_path: Path, script: str, args: list[str]
) -> None:
    out = tmp_path / "out"
    argv = [a.format(out=out) for a in args]
    proc = _bash(str(SCRIPTS / script), *argv, env=_env(tmp_path, pip_rc=1), timeout=180)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    if script == "run_all.sh":  # one call gathers everything: the failure is in its summary
        summary = (out / "summary.txt").read_text()
        assert re.search(r"^install +exit 1 ", summary, re.M), summary
        assert "setup_tree: FAILED" in summary and "skipped" in summary
        assert not (out / "bench.json").exists()
    else:
        assert "setup_tree: FAILED" in proc.stderr, proc.stderr
    assert {p.name for p in out.iterdir()} <= SETUP_ONLY, sorted(p.name for p in out.iterdir())


def test_final_check_reports_each_steps_real_status_and_fails(
    tmp_path: Path, tree_is_installed: None
) -> None:
    out = tmp_path / "out"
    proc = _bash(str(SCRIPTS / "final_check.sh"), str(out), env=_env(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (out / "pytest.log").read_text().splitlines()[-1] == "pytest exit 4"
    assert (out / "kit.log").read_text().splitlines()[-1] == "kit exit 4"
    assert (out / "bench.log").read_text().splitlines()[-1] == "bench exit 4"
    assert "3 step(s) failed" in proc.stderr


def test_policy_loss_names_a_skipped_step_and_fails_on_failed_ones(
    tmp_path: Path, tree_is_installed: None
) -> None:
    out = tmp_path / "out"
    env = {**_env(tmp_path), "PLB_LIMIT": "0"}
    proc = _bash(str(SCRIPTS / "policy_loss.sh"), str(out), env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "bench exit 4" in (out / "bench.log").read_text()
    plb = (out / "plb.log").read_text()
    assert "skipped" in plb and "exit 0" not in plb  # not the status of a `[[ ]]` test
    checks = (out / "checks.log").read_text()
    assert checks.count(" exit 4") == 4
    assert "host profile exit 7" in (out / "host_profile.log").read_text()


def test_no_script_installs_but_setup_tree_or_names_a_fixed_tmp_path() -> None:
    for script in sorted(SCRIPTS.glob("*.sh")):
        text = script.read_text()
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert "/tmp" not in text, f"{script.name} names a fixed /tmp path"
        if script.name == "setup_tree.sh":
            continue
        assert not re.search(r"bash\s+\S*install-wheels", code), (
            f"{script.name} runs install-wheels"
        )
        assert not re.search(r"pip install[^\n]*\./core", code), f"{script.name} installs ./core"
        for line in code.splitlines():
            if re.search(r"(^|\s)(source|\.) \S*setup_tree\.sh", line):
                assert line.rstrip().endswith("|| exit 1"), f"{script.name}: {line.strip()}"
    for script in sorted(SCRIPTS.glob("*.py")):
        assert "/tmp" not in script.read_text(), f"{script.name} names a fixed /tmp path"
