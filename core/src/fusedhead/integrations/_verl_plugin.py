"""The ``verl.plugins`` entry point: ``import verl`` imports this, and it installs the patch.

Kept tiny: it imports neither torch nor any verl module, only arms
:func:`fusedhead.integrations.verl.install`, which patches verl's ``monkey_patch`` module when
verl imports it (and VeOmni's loss mapping, for verl's VeOmni engine).
``VERL_USE_EXTERNAL_PLUGINS=none`` (verl's switch) turns it off. ``FUSEDHEAD_VERL_FIX_TRL_PROBE=1``
(an on/off value, read by :func:`fusedhead.env_flags.env_flag`) also turns on
:func:`fusedhead.integrations.verl.fix_trl_value_head_probe`.
"""

from __future__ import annotations

import warnings

from fusedhead.env_flags import env_flag
from fusedhead.integrations.verl import fix_trl_value_head_probe, install

install()
# Opt-in, for verl's Ray workers: verl 0.9.1 beside TRL >= 1.16 (see fix_trl_value_head_probe).
# verl's loader swallows a plugin's exception (logged at debug level), so a value that is not
# on/off is a warning naming it, and the fix stays off.
try:
    fix_probe = env_flag("FUSEDHEAD_VERL_FIX_TRL_PROBE")
except ValueError as exc:
    warnings.warn(f"fusedhead: {exc}; the TRL probe fix is not applied", stacklevel=1)
    fix_probe = False
if fix_probe:
    fix_trl_value_head_probe()
