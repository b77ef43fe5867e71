#!/usr/bin/env bash
# Install the RL trainers whose integrations the tests exercise (pinned), into the .venv that
# scripts/setup.sh made. Each trainer's install lives in scripts/trainers/<trainer>.sh; all of them
# keep torch at the version setup.sh installed (a trainer must never pull another torch build).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "run scripts/setup.sh first" >&2; exit 1; }
torch_version=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
constraints=$(mktemp)
echo "torch==${torch_version}" > "$constraints"
export FUSEDHEAD_PIP_CONSTRAINTS="$constraints"
for script in scripts/trainers/*.sh; do
    [ -e "$script" ] || continue
    echo "setup-trainers: $(basename "$script" .sh)"
    bash "$script"
done
rm -f "$constraints"
.venv/bin/python -c "import torch; assert torch.__version__.startswith('${torch_version}'), torch.__version__"
echo "setup-trainers: ok"
