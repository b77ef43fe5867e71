"""Where Liger's native SM90 kernel runs, and a message that says why not and what to do.

Liger itself would import its CuTe DSL kernel on any compute capability 9.0 GPU (ImportError when
the DSL is missing, TypeError for non-bf16 inputs) and silently run its chunked path everywhere
else. The adapter asks the same questions up front and turns every "no" into one clear error.
Each reason carries its kind, and the fixes offered are chosen by kind, never by its wording.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fusedhead_liger import _liger

NATIVE_CAPABILITY = (9, 0)
INSTALL_HINT = (
    f"pip install 'nvidia-cutlass-dsl[cu13]=={_liger.TESTED_CUTE_DSL}' "
    "'apache-tvm-ffi==0.1.15.post2' (the pins of fusedhead-liger[sm90]; Linux x86-64)"
)

ReasonKind = Literal["device", "dtype", "dsl_missing", "dsl_import"]


@dataclass(frozen=True)
class Reason:
    """One reason the native kernel cannot run: its kind (which picks the fix) and its text."""

    kind: ReasonKind
    text: str

    def __str__(self) -> str:
        return self.text


def device_reasons(device: torch.device) -> list[Reason]:
    """Reasons the device cannot run the SM90 kernel (empty when it can)."""

    def no(text: str) -> list[Reason]:
        return [Reason("device", text)]

    if device.type != "cuda":
        return no(
            f"device {device} is not a CUDA GPU: Liger's native kernel is an SM90 (Hopper) CUDA kernel"
        )
    if torch.version.hip is not None:
        return no(f"device {device} is a ROCm GPU: Liger's native kernel is an NVIDIA SM90 kernel")
    if not torch.cuda.is_available():
        return no("CUDA is not available to this torch build or process")
    cap = torch.cuda.get_device_capability(device)
    if cap != NATIVE_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return no(
            f"{name} has compute capability {cap[0]}.{cap[1]}; Liger's native kernel runs on 9.0 only "
            "(H100/H200). Liger itself would silently run its chunked fallback here"
        )
    return []


def dtype_reasons(dtype: torch.dtype) -> list[Reason]:
    """Reasons the dtype cannot run the SM90 kernel (Liger would raise a TypeError)."""
    if dtype == torch.bfloat16:
        return []
    return [Reason("dtype", f"inputs are {dtype}, Liger's native kernel takes bfloat16 only")]


def dsl_reasons(device: torch.device) -> list[Reason]:
    """Reasons the CuTe DSL path cannot be imported; imports it only on a device that could run it
    (liger-kernel's own import failing there raises, as liger-kernel's: ``_liger._import``)."""
    if not _liger.cute_dsl_installed():
        return [Reason("dsl_missing", "the CuTe DSL (nvidia-cutlass-dsl) is not installed")]
    if device_reasons(device):
        return []  # installed; importing it would prove nothing on this device
    error = _liger.native_import_error()
    if error is None:
        return []
    return [Reason("dsl_import", f"Liger's CuTe DSL kernel does not import ({error})")]


def native_reasons(device: torch.device, dtype: torch.dtype) -> list[Reason]:
    """Every reason the native kernel cannot run on (device, dtype); empty when it can."""
    return device_reasons(device) + dtype_reasons(dtype) + dsl_reasons(device)


def native_unavailable_message(
    device: torch.device, dtype: torch.dtype, reasons: list[Reason]
) -> str:
    """The error text: what is missing and each way out."""
    kinds = {r.kind for r in reasons}
    fixes = []
    if "dsl_missing" in kinds:
        fixes.append(f"install the CuTe DSL: {INSTALL_HINT}")
    if "dsl_import" in kinds:
        cutlass = _liger.distribution_version("nvidia-cutlass-dsl") or "of unknown version"
        fixes.append(
            f"the CuTe DSL is installed (nvidia-cutlass-dsl {cutlass}) but Liger's SM90 module "
            f"fails to import with it: fix that error; the tested set is {INSTALL_HINT}"
        )
    if "dtype" in kinds:
        fixes.append(
            "pass bfloat16 hidden and weight (e.g. under torch.autocast(dtype=torch.bfloat16))"
        )
    if "device" in kinds:
        fixes.append("run on an H100/H200 GPU")
    others = 'backend="triton" or backend="torch"' if device.type == "cuda" else 'backend="torch"'
    fixes.append(
        'use options={"implementation": "fallback"} to run Liger\'s chunked path on purpose, '
        f"or another backend (e.g. {others})"
    )
    why = "; ".join(str(r) for r in reasons)
    how = "; ".join(fixes)
    return (
        f"backend 'liger' with implementation='native' cannot run on {device} with {dtype}: {why}. "
        f"Fix: {how}."
    )
