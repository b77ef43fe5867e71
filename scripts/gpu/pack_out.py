"""pack_out.py OUT MAX KEEP...: leave at most MAX entries in OUT, folders included.

Files named in KEEP stay (in that order of priority) as long as room is left for one archive;
everything else (other files, folders) goes into OUT/extra.tar.gz. So what comes back from the GPU
machine never exceeds its file limit and is never deeper than it allows.
"""

from __future__ import annotations

import shutil
import sys
import tarfile
from pathlib import Path


def main(out: Path, limit: int, keep: list[str]) -> int:
    entries = sorted(p for p in out.iterdir())
    if len(entries) <= limit and all(p.is_file() for p in entries):
        return 0
    present = [out / k for k in keep if (out / k).is_file()]
    stay = present[: limit - 1]
    rest = [p for p in entries if p not in stay]
    archive = out / "extra.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for p in rest:
            tar.add(p, arcname=p.name)
    for p in rest:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    print(f"pack_out: packed {', '.join(p.name for p in rest)} into {archive.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
