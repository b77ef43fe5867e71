"""Glue for the frameworks RL trainers build on; each submodule imports its framework lazily.

- ``fusedhead.integrations.transformers``: ``causal_lm_logprobs`` for Hugging Face causal LMs.
- ``fusedhead.integrations.demo_model``: ``fusedhead demo --model tiny-llama|tiny-qwen2``.
"""
