"""The ``verl.plugins`` entry point: ``import verl`` imports this, and it installs the patch.

Kept tiny: it imports neither torch nor any verl module, only arms
:func:`fusedhead.integrations.verl.install`, which patches verl's ``monkey_patch`` module when
verl imports it (and VeOmni's loss mapping, for verl's VeOmni engine).
``VERL_USE_EXTERNAL_PLUGINS=none`` (verl's switch) turns it off.
"""

from __future__ import annotations

from fusedhead.integrations.verl import install

install()
