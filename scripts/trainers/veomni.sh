#!/usr/bin/env bash
# VeOmni 0.1.12 for tests/trainers/test_veomni*.py, on the CPU, into the .venv of scripts/setup.sh.
# VeOmni itself goes in without its dependencies (its GPU stack: flash-attn, liger, quack, ...);
# then only what `import veomni` and build_foundation_model import. VeOmni 0.1.12's modeling code
# is generated from transformers 5.9 and imports names transformers 5.23 removed, hence the range.
# torch stays as setup.sh installed it (FUSEDHEAD_PIP_CONSTRAINTS, from setup-trainers.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
# The trainers come without their dependency lists on purpose: pip's report of their unmet
# requirements after each install is expected, so it is not printed (--no-warn-conflicts).
constraints=(--no-warn-conflicts)
[ -n "${FUSEDHEAD_PIP_CONSTRAINTS:-}" ] && constraints+=(-c "$FUSEDHEAD_PIP_CONSTRAINTS")
pip() { .venv/bin/python -m pip "$@"; }
pip install -q "${constraints[@]}" --no-deps veomni==0.1.12
pip install -q "${constraints[@]}" "transformers>=5.9,<5.23" "einops>=0.8.1" psutil
.venv/bin/python -c "import veomni, veomni.models, veomni.ops.kernels.cross_entropy; print('veomni', veomni.__version__)"
