"""On/off environment variables, read one way everywhere (``FUSEDHEAD_TRACEBACK``,
``FUSEDHEAD_VERL_FIX_TRL_PROBE``). A leaf module: verl's plugin entry point reads it on
``import verl``, before torch.
"""

from __future__ import annotations

import os

__all__ = ["env_flag"]

_ENV_TRUE = ("1", "true", "yes", "on")
_ENV_FALSE = ("0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """An on/off environment variable (1/0, true/false, yes/no, on/off, any case; unset or blank
    is off); another value is a ValueError naming it, never read as off."""
    raw = os.environ.get(name, "").strip()
    if raw.lower() in _ENV_TRUE:
        return True
    if not raw or raw.lower() in _ENV_FALSE:
        return False
    raise ValueError(
        f"{name}={raw!r} is not an on/off value: expected one of "
        f"{', '.join(_ENV_TRUE)} (on) or {', '.join(_ENV_FALSE)} (off), in any case"
    )
