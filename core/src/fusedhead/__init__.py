"""fusedhead: per-token log-probs and entropy from hidden states and an LM-head weight.

Importing this package imports no torch and no backend; a backend is imported only when a call
selects it by name.
"""

from __future__ import annotations

__version__ = "0.1.0"
