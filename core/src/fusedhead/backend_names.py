"""What a backend's name may be: the rule every name follows, the names reserved for the project's
own distributions, the entry-point group that claims names, and the variable limiting discovery.

A leaf: the registry selects by these, and its errors (:mod:`fusedhead.registry_messages`) name
them; ``fusedhead.registry`` re-exports each.
"""

from __future__ import annotations

import re

ENTRY_POINT_GROUP = "fusedhead.backends"
#: A backend name, whole (``\Z``: ``$`` would let a final newline in).
NAME_PATTERN = re.compile(r"\A[a-z0-9_-]+\Z")
#: Environment variable limiting discovery to a comma-separated list of names.
LIMIT_ENV = "FUSEDHEAD_BACKENDS"
#: Reserved names: each may only come from the project's own distribution (normalized name).
RESERVED_NAMES = {
    "torch": "fusedhead-torch",
    "triton": "fusedhead-triton",
    "liger": "fusedhead-liger",
}
