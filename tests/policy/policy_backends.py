"""The backends whose policy loss the suite checks: each first-party backend that declares it."""

from __future__ import annotations

#: On the CPU the triton backend runs under TRITON_INTERPRET=1 (tests/conftest.py sets it).
POLICY_BACKENDS = ["torch", "triton"]
