#!/usr/bin/env bash
# Set up a development environment in .venv: CPU torch first (so nothing pulls a multi-GB CUDA
# build), then the core and every first-party backend as editable installs, then test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip
# A pip with no index or wheel folder of its own reads PyPI, whose Linux torch is the CUDA build:
# take torch from PyTorch's CPU index there. A configured pip (a mirror, a wheel folder) is kept.
torch_from=()
if [ -z "$(pip config list 2>/dev/null)" ] &&
    [ -z "${PIP_INDEX_URL:-}${PIP_EXTRA_INDEX_URL:-}${PIP_FIND_LINKS:-}${PIP_NO_INDEX:-}" ]; then
    torch_from=(--index-url https://download.pytorch.org/whl/cpu)
fi
pip install -q ${torch_from[@]+"${torch_from[@]}"} torch==2.13.0
pip install -q -e "./core[testing,yaml,bench,transformers]" \
    -e ./plugins/torch_backend -e ./plugins/triton_backend -e ./plugins/liger_backend
pip install -q ruff==0.17.6 mypy==2.4.1 pytest-xdist==3.8.0 omegaconf build hatchling editables
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "setup: ok ($(.venv/bin/python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'))"
