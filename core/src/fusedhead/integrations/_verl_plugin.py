"""The ``verl.plugins`` entry point: ``import verl`` imports this, and it installs the patch.

Kept tiny: it imports neither torch nor any verl module, only arms
:func:`fusedhead.integrations.verl.install`, which patches verl's ``monkey_patch`` module when
verl imports it (and VeOmni's loss mapping, for verl's VeOmni engine).
``VERL_USE_EXTERNAL_PLUGINS=none`` (verl's switch) turns it off. ``FUSEDHEAD_VERL_FIX_TRL_PROBE=1``
also turns on :func:`fusedhead.integrations.verl.fix_trl_value_head_probe`.
"""

from __future__ import annotations

import os

from fusedhead.integrations.verl import fix_trl_value_head_probe, install

install()
# Opt-in, for verl's Ray workers: verl 0.9.1 beside TRL >= 1.16 (see fix_trl_value_head_probe).
if os.environ.get("FUSEDHEAD_VERL_FIX_TRL_PROBE", "") not in ("", "0"):
    fix_trl_value_head_probe()
