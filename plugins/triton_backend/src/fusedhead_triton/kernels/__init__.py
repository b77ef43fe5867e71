"""Triton kernels (``@triton.jit``, constexpr tile sizes). Launchers live in ``launch.py``."""
