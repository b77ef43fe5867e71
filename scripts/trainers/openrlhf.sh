#!/usr/bin/env bash
# OpenRLHF for tests/trainers/test_openrlhf.py, pinned, without its dependency list (ray, vllm,
# flash-attn, wandb, ... are for training clusters): only what `import openrlhf.models` needs.
# flash-attn cannot build without CUDA; the tests bring a stand-in for the four padding helpers
# OpenRLHF imports from it (tests/trainers/openrlhf_stubs). DeepSpeed is a source distribution
# whose setup imports torch: built against the venv's torch (no build isolation, no CUDA ops).
# torch stays at the version setup.sh installed. About 30 s when the wheels are cached.
set -euo pipefail
cd "$(dirname "$0")/../.."
# The trainers come without their dependency lists on purpose: pip's report of their unmet
# requirements after each install is expected, so it is not printed (--no-warn-conflicts).
constraints=(--no-warn-conflicts)
[ -n "${FUSEDHEAD_PIP_CONSTRAINTS:-}" ] && constraints+=(-c "$FUSEDHEAD_PIP_CONSTRAINTS")
.venv/bin/python -m pip install -q "${constraints[@]}" --no-deps "openrlhf==0.11.2"
# A source build without isolation needs setuptools and wheel in the venv first.
.venv/bin/python -m pip install -q "${constraints[@]}" setuptools wheel
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q "${constraints[@]}" --no-build-isolation \
    "deepspeed==0.19.6" "peft==0.21.2" "einops==0.8.2" "pylatexenc==2.11" "sympy"
# The stand-in goes on the path only where the real flash-attn is absent (as in the tests).
.venv/bin/python - <<'PY'
import importlib.metadata, importlib.util, sys
if importlib.util.find_spec("flash_attn") is None:
    sys.path.insert(0, "tests/trainers/openrlhf_stubs")
import openrlhf.models.actor  # noqa: F401
print("openrlhf", importlib.metadata.version("openrlhf"))
PY
