"""Glue for the frameworks RL trainers build on; each submodule imports its framework lazily.

- ``fusedhead.integrations.transformers``: ``causal_lm_logprobs`` for Hugging Face causal LMs.
- ``fusedhead.integrations.demo_model``: ``fusedhead demo --model tiny-llama|tiny-qwen2``.
- ``fusedhead.integrations.lm_head``: ``lm_head_logprobs`` for a trainer's own LM head and hidden
  states with already-shifted labels (packed or padded).
- ``fusedhead.integrations.backend_spec``: ``parse_backend_spec`` for ``"fusedhead:<name>"``
  config values, and the head a trainer setting names. Both importable from here (on first use).
- ``fusedhead.integrations.verl``: verl's ``impl_backend: fusedhead:<name>`` (a ``verl.plugins``
  entry point, ``docs/integrations/verl.md``).
- ``fusedhead.integrations.veomni``: VeOmni's ``cross_entropy_loss_implementation:
  fusedhead:<name>`` (its ``KERNEL_REGISTRY``, ``docs/integrations/veomni.md``).
- ``fusedhead.integrations.trl``: TRL's fused LM head on a fusedhead backend
  (``FusedHead{GRPO,RLOO,SFT,DPO,KTO}Trainer``, ``docs/integrations/trl.md``), built on
  ``trl_config`` (the head a TRL config names, and its device) and ``trl_policy_loss`` (GRPO's
  loss from ``fused_policy_loss``).
- ``fusedhead.integrations.openrlhf``: ``patch_actor``, an opt-in patch of OpenRLHF's
  ``Actor.forward`` (``docs/integrations/openrlhf.md``).
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "lm_head_logprobs": "fusedhead.integrations.lm_head",
    "parse_backend_spec": "fusedhead.integrations.backend_spec",
    "is_fusedhead_spec": "fusedhead.integrations.backend_spec",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    """Load the names above on first use (importing this package imports no torch)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fusedhead.integrations' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
