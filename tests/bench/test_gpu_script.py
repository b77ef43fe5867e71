"""scripts/gpu/run_all.sh rehearsed on the CPU: pip and nvidia-smi stubbed, tiny shapes.

The script is the one GPU call of a release; it cannot be tried on a GPU before that call, so
its plumbing (joining wheel pieces, step time limits and statuses, two bench processes appending
to one JSON, the cap on files brought back) is checked here.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "gpu"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or not sys.platform.startswith("linux"),
    reason="needs bash on Linux",
)


def _split_wheel(folder: Path, pieces: int) -> list[Path]:
    """A small valid wheel split into ``pieces`` byte ranges named like the CuTe DSL's."""
    whl = folder / "demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("demo_pkg/__init__.py", os.urandom(3000).hex())
    data = whl.read_bytes()
    whl.unlink()
    step = len(data) // pieces + 1
    out = []
    for i in range(pieces):
        part = folder / f"{whl.name}.part-a{'abcdefgh'[i]}"
        part.write_bytes(data[i * step : (i + 1) * step])
        out.append(part)
    return out


def _stub_bin(tmp_path: Path) -> Path:
    """python3 -> this interpreter, except ``python3 -m pip`` (a no-op); nvidia-smi prints a stub."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == "-m" && "$2" == "pip" ]]; then echo "stub pip: $*"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    (bindir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'GPU 0: stub'\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    return bindir


def test_join_parts_keeps_complete_wheels_only(tmp_path: Path) -> None:
    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    a.mkdir()
    b.mkdir()
    first, *rest = _split_wheel(tmp_path, 3)
    first.rename(a / first.name)
    for p in rest:
        p.rename(b / p.name)
    out = subprocess.run(
        ["bash", str(SCRIPTS / "join_parts.sh"), str(dest), str(a), str(b)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "3 pieces" in out and "valid" in out
    assert len(list(dest.iterdir())) == 3
    # Without the first folder (the machine went cold between the two calls): nothing is kept.
    dest2 = tmp_path / "dest2"
    out = subprocess.run(
        ["bash", str(SCRIPTS / "join_parts.sh"), str(dest2), str(b)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "no first piece" in out and not list(dest2.iterdir())
    # A missing middle piece makes an invalid zip: dropped.
    (b / rest[0].name).unlink()
    dest3 = tmp_path / "dest3"
    out = subprocess.run(
        ["bash", str(SCRIPTS / "join_parts.sh"), str(dest3), str(a), str(b)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "dropped" in out and not list(dest3.iterdir())


def test_pack_out_leaves_at_most_the_limit(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    keep = ["summary.txt", "bench.json", "bench.md"]
    for name in [*keep, *(f"x{i}.log" for i in range(8))]:
        (out / name).write_text(name)
    (out / "extra").mkdir()
    (out / "extra" / "deep.json").write_text("{}")
    subprocess.run([sys.executable, str(SCRIPTS / "pack_out.py"), str(out), "4", *keep], check=True)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([*keep, "extra.tar.gz"])
    with tarfile.open(out / "extra.tar.gz") as tar:
        packed = tar.getnames()
    assert "x0.log" in packed and "extra/deep.json" in packed


@pytest.mark.slow
def test_run_all_rehearsal_on_the_cpu(tmp_path: Path) -> None:
    pytest.importorskip("fusedhead_torch", reason="needs fusedhead-torch installed")
    parts_a, parts_b = tmp_path / "part-a", tmp_path / "part-b"
    parts_a.mkdir()
    parts_b.mkdir()
    first, second = _split_wheel(tmp_path, 2)
    first.rename(parts_a / first.name)
    second.rename(parts_b / second.name)
    out = tmp_path / "out"
    # The real install-wheels lives in the git-ignored .gpu-wheels of a developer's tree; a clean
    # clone (CI) has none, so the rehearsal brings a stand-in that installs nothing.
    wheels = tmp_path / "wheels"
    (wheels / "small").mkdir(parents=True)
    (wheels / "install-wheels").write_text(
        '#!/usr/bin/env bash\necho "install-wheels (stand-in): $*"\n'
    )
    env = {
        **os.environ,
        "WHEELS": str(wheels),
        "PATH": f"{_stub_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}",
        "OUT": str(tmp_path / "decoy"),  # the folder given as --out wins over $OUT
        "DEVICE": "cpu",
        "DTYPE": "fp32",
        "STEPS": "install bench",
        "BENCH_SHAPE": "--n 24 48 --hidden 8 --vocab 100 --no-memory",
        "BENCH_IMPLS": "torch reference",
        "BENCH_LAST_IMPLS": "verl-chunked",
        "DEADLINE_S": "300",
    }
    proc = subprocess.run(
        ["bash", str(SCRIPTS / "run_all.sh"), "--out", str(out), str(parts_b), str(parts_a)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "decoy").exists()
    summary = (out / "summary.txt").read_text()
    for step in ("install", "env", "list", "bench", "bench-last", "bench-report"):
        assert any(
            line.startswith(step + " ") and " ok " in line for line in summary.splitlines()
        ), (step, summary)
    assert "demo_pkg-1.0-py3-none-any.whl: 2 pieces" in summary
    # The one setup path: the carried wheels with the joined pieces, then this tree, checked.
    assert "install-wheels (stand-in): " in summary and "/parts" in summary
    assert "--no-index --no-deps --no-build-isolation ./core" in summary
    version = importlib.metadata.version("fusedhead-liger")
    assert f"fusedhead-liger {version}: from this tree's plugins/liger_backend" in summary
    assert "failed:" not in summary
    # The logs are committed beside the figures: they name no path of the machine they ran on.
    step_lines = [line for line in summary.splitlines() if line.startswith("===== ")]
    shown_paths = (str(ROOT), str(out), "/tmp/tmp.")  # the checkout, $OUT, the script's mktemp -d
    assert step_lines and not [x for x in step_lines if any(p in x for p in shown_paths)], (
        step_lines
    )
    records = json.loads((out / "bench.json").read_text())
    assert [(r["case"]["n"], r["impl"]) for r in records] == [
        (24, "torch"),
        (24, "reference"),
        (48, "torch"),
        (48, "reference"),
        (24, "verl-chunked"),
        (48, "verl-chunked"),
    ]
    assert all(r["status"] == "ok" for r in records)
    assert "| verl-chunked |" in (out / "bench.md").read_text()
    entries = list(out.iterdir())
    assert len(entries) <= 8 and all(p.is_file() for p in entries)


def test_every_gpu_script_that_writes_outputs_takes_the_folder_as_an_argument():
    """A stranger's GPU machine has no $OUT convention: the output folder is an argument.

    Each script of scripts/gpu/ that writes under "$OUT" sets OUT from a positional parameter
    or --out (the environment and ./.gpu-out only as defaults), and its header's usage names it.
    """
    takes = re.compile(r"^\s*OUT=\$\{\d[:?]", re.M)
    for script in sorted(SCRIPTS.glob("*.sh")):
        text = script.read_text()
        if '"$OUT' not in text:
            continue
        assert takes.search(text), f"{script.name}: OUT comes only from the environment"
        header = "\n".join(line for line in text.splitlines()[1:12] if line.startswith("#"))
        usage = re.search(rf"{re.escape(script.name)} [^:\n]*\bOUT\b", header)
        assert usage, f"{script.name}: no usage line in its header names OUT:\n{header}"
