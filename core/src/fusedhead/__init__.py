"""fusedhead: per-token log-probs and entropy from hidden states and an LM-head weight.

Importing this package imports no torch and no backend; a backend is imported only when a call
selects it by name. The public names below load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "1.0.0"

_LAZY = {
    "fused_head": "fusedhead.api",
    "fused_kl": "fusedhead.api",
    "fused_policy_loss": "fusedhead.api",
    "PolicyLossOutput": "fusedhead.policy_output",
    "PolicyLossCall": "fusedhead.protocol",
    "PolicyLossResult": "fusedhead.protocol",
    "FusedHead": "fusedhead.api",
    "FusedHeadOutput": "fusedhead.api",
    "FusedHeadConfig": "fusedhead.config",
    "register_backend": "fusedhead.registry",
    "unregister_backend": "fusedhead.registry",
    "Capabilities": "fusedhead.protocol",
    "HeadCall": "fusedhead.protocol",
    "HeadOutput": "fusedhead.protocol",
    "refresh": "fusedhead.registry",
    "FusedHeadBackend": "fusedhead.protocol",
    "PLUGIN_API_VERSION": "fusedhead.protocol",
    "reference_fused_head": "fusedhead.reference",
    "FusedLMHead": "fusedhead.module",
}

__all__ = [
    "PLUGIN_API_VERSION",
    "Capabilities",
    "FusedHead",
    "FusedHeadBackend",
    "FusedHeadConfig",
    "FusedHeadOutput",
    "FusedLMHead",
    "HeadCall",
    "HeadOutput",
    "PolicyLossCall",
    "PolicyLossOutput",
    "PolicyLossResult",
    "__version__",
    "fused_head",
    "fused_kl",
    "fused_policy_loss",
    "reference_fused_head",
    "refresh",
    "register_backend",
    "unregister_backend",
]

if TYPE_CHECKING:
    from fusedhead.api import FusedHead, FusedHeadOutput, fused_head, fused_kl, fused_policy_loss
    from fusedhead.config import FusedHeadConfig
    from fusedhead.module import FusedLMHead
    from fusedhead.policy_output import PolicyLossOutput
    from fusedhead.protocol import (
        PLUGIN_API_VERSION,
        Capabilities,
        FusedHeadBackend,
        HeadCall,
        HeadOutput,
        PolicyLossCall,
        PolicyLossResult,
    )
    from fusedhead.reference import reference_fused_head
    from fusedhead.registry import refresh, register_backend, unregister_backend


def __dir__() -> list[str]:
    """The module's names and the public ones imported on first use (``__all__``)."""
    return sorted({*globals(), *__all__})


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fusedhead' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
