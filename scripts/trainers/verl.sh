#!/usr/bin/env bash
# verl 0.9.1 for tests/trainers/test_verl*.py, on the CPU, into the .venv of scripts/setup.sh.
# verl itself goes in without its dependencies (ray[default], wandb, tensorboard, torchdata, ... are
# for clusters and minutes of downloads); then only what `import verl`, its FSDP engine module and
# apply_fsdp2 import. torch stays as setup.sh installed it (FUSEDHEAD_PIP_CONSTRAINTS, from setup-trainers.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
# The trainers come without their dependency lists on purpose: pip's report of their unmet
# requirements after each install is expected, so it is not printed (--no-warn-conflicts).
constraints=(--no-warn-conflicts)
[ -n "${FUSEDHEAD_PIP_CONSTRAINTS:-}" ] && constraints+=(-c "$FUSEDHEAD_PIP_CONSTRAINTS")
pip() { .venv/bin/python -m pip "$@"; }
pip install -q "${constraints[@]}" --no-deps verl==0.9.1
# import verl: ray, tensordict (verl wants <=0.10); the engine module: peft, datasets, codetiming.
pip install -q "${constraints[@]}" ray==2.60.0 tensordict==0.10.0 peft==0.21.2 codetiming==1.4.0 \
    "datasets>=4.7" "transformers>=5.5.3"
# verl's trainer composes ppo_trainer.yaml with hydra and builds its config dataclasses with
# hydra's instantiate (tests/trainers/test_verl_yaml_config.py). verl declares hydra-core
# unpinned; 1.3.8 is the newest. It declares omegaconf<2.4, so it goes in without its
# dependencies (its parser's antlr4 runtime beside it): setup.sh's omegaconf stays, which
# composes and instantiates verl's config, as that test checks.
pip install -q "${constraints[@]}" --no-deps hydra-core==1.3.8 antlr4-python3-runtime==4.9.3
.venv/bin/python -c "import verl, verl.workers.engine.fsdp.transformer_impl, verl.utils.fsdp_utils, hydra; print('verl', verl.__version__, 'hydra', hydra.__version__)"
