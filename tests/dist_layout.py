"""Where the distributions live in this checkout: the packaging tests and the version checks."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "build-dists"
#: distribution -> (project folder, package folder under src/)
DISTS = {
    "fusedhead": ("core", "fusedhead"),
    "fusedhead-torch": ("plugins/torch_backend", "fusedhead_torch"),
    "fusedhead-triton": ("plugins/triton_backend", "fusedhead_triton"),
    "fusedhead-liger": ("plugins/liger_backend", "fusedhead_liger"),
    "fusedhead-example-batchinvariant": ("examples/third_party_backend", "fusedhead_example_bi"),
}
