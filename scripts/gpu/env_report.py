"""Print what the GPU run runs on: device, driver, Python packages that matter, CuTe DSL status."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import platform

import torch

print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
for dist in (
    "fusedhead",
    "fusedhead-torch",
    "fusedhead-triton",
    "fusedhead-liger",
    "triton",
    "liger-kernel",
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-cu13",
    "cut-cross-entropy",
    "pydantic",
    "matplotlib",
    "pytest",
):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "not installed")
for module in ("cutlass.cute", "liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90"):
    try:
        importlib.import_module(module)
        print(module, "imports")
    except Exception as exc:  # report, never fail
        print(module, f"does not import: {type(exc).__name__}: {exc}")
