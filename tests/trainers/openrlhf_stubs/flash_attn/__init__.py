"""A CPU stand-in for the padding helpers of flash-attn that OpenRLHF imports (tests only)."""

__version__ = "0.0.0+fusedhead-test-stub"
