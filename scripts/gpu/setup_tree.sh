#!/usr/bin/env bash
# setup_tree.sh LOG: install the carried wheels (.gpu-wheels/small, by .gpu-wheels/install-wheels;
# WHEELS sets the folder) and this tree's core, torch and triton backends, from the repository
# root, into LOG. Sourced by the GPU scripts, which then export FUSEDHEAD_GIT_COMMIT from
# .gpu-stamp so that every bench record names the tree.
LOG=${1:?usage: setup_tree.sh LOG}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[[ -f .gpu-stamp ]] && export FUSEDHEAD_GIT_COMMIT=$(<.gpu-stamp)
{
  bash "${WHEELS:-.gpu-wheels}/install-wheels" "${WHEELS:-.gpu-wheels}/small"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation ./core \
    ./plugins/torch_backend ./plugins/triton_backend
} >"$LOG" 2>&1
