#!/usr/bin/env bash
# TRL for tests/trainers/test_trl.py, pinned; torch stays at the version setup.sh installed.
# scripts/setup-trainers.sh runs it with FUSEDHEAD_PIP_CONSTRAINTS set. About 10 s when the
# wheels are cached: TRL is pure Python; it brings accelerate and datasets.
set -euo pipefail
cd "$(dirname "$0")/../.."
# The trainers come without their dependency lists on purpose: pip's report of their unmet
# requirements after each install is expected, so it is not printed (--no-warn-conflicts).
constraints=(--no-warn-conflicts)
[ -n "${FUSEDHEAD_PIP_CONSTRAINTS:-}" ] && constraints+=(-c "$FUSEDHEAD_PIP_CONSTRAINTS")
.venv/bin/python -m pip install -q "${constraints[@]}" "trl==1.16.0"
.venv/bin/python -c "import trl.trainer.utils as u; assert hasattr(u, 'add_fused_lm_head'); print('trl', __import__('trl').__version__)"
