"""What ``fusedhead bench`` measures: installed fusedhead backends by name, and the peers.

Peers are the implementations users compare against: ``reference`` (full logits through autograd),
``verl-chunked`` (verl's 512-row algorithm as liger-kernel ships it), ``liger-direct`` (liger-kernel's
public function, only where it runs its own kernel) and ``cce`` (Apple's Cut Cross-Entropy, which
computes no entropy). Every implementation is a function ``fn(hidden, weight, labels) ->
(log_probs fp32, entropy fp32 or None)`` built for one case; ``availability(case)`` says why it
cannot run there (None when it can), so the bench records a skip with the reason instead of failing.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata as md
import importlib.util
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from fusedhead import registry
from fusedhead.bench import heads, policy
from fusedhead.bench.cases import ELEMENT_BYTES, IGNORE_INDEX, Case
from fusedhead.cli import json_type
from fusedhead.errors import (
    BackendConflictError,
    BackendError,
    BackendLoadError,
    BackendUnavailableError,
)
from fusedhead.options import load_json

Fn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]
]

PEERS = ("reference", "verl-chunked", "liger-direct", "cce")
_LIGER_MODULE = "liger_kernel.ops.fused_linear_scaled_cross_entropy"
_LIGER_SM90_MODULE = "liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90"
#: Estimated peak of the full-logits reference, in fp32 ``[N, V]`` buffers (docs/design.md's table: 5x).
REFERENCE_LOGIT_COPIES = 5.5
#: Fraction of the free memory the reference may be estimated to use before it is skipped.
REFERENCE_FREE_FRACTION = 0.7


@dataclass
class Impl:
    """One implementation under test; ``spec`` rebuilds it in another process."""

    name: str
    spec: str
    kind: str  # "backend" or "peer"
    entropy: bool
    availability: Callable[[Case], str | None]
    build: Callable[[Case], Fn]
    distributions: tuple[str, ...] = ()
    note: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    def versions(self) -> dict[str, str | None]:
        """Installed versions of the distributions this implementation comes from."""
        return {d: dist_version(d) for d in self.distributions}


def dist_version(name: str) -> str | None:
    """Installed version of a distribution, or None."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# --- fusedhead backends -------------------------------------------------------------------------


def _backend(name: str, options: dict[str, Any], spec: str) -> Impl:
    """A fusedhead backend by its exact name; unknown names and bad options raise now.

    A backend that is installed but does not load (broken, incompatible, conflicting) gives an
    implementation that reports the load error on every case, so one broken plugin costs only its
    own rows of the table.
    """
    from fusedhead.config import validate_options

    try:
        cand = registry.find(name)  # an unknown name raises, listing what is installed
    except (BackendConflictError, BackendLoadError) as exc:  # installed, never selectable
        return _broken(name, spec, exc, exc.distribution)
    try:
        cls = registry.load_class(name)
    except BackendError as exc:
        return _broken(name, spec, exc, cand.distribution)
    validate_options(name, cls, options)  # a ValueError naming the backend and the option
    label = (
        name
        if not options
        else f"{name}[{','.join(f'{k}={v}' for k, v in sorted(options.items()))}]"
    )

    def availability(case: Case) -> str | None:
        from fusedhead.config import validate_options

        cls = registry.load_class(name)
        backend = cls(validate_options(name, cls, options))
        device = torch.device(case.device)
        caps = backend.capabilities(device)
        # First: what the backend declares it never computes (no install or device makes it
        # run the case), every declared limit a skip with its reason, never the call's error.
        why = heads.refusal(case.head, caps, temperature=case.temperature)
        if why is not None:
            return f"backend {name!r} {why}"
        if device.type not in caps.devices:
            try:  # the backend's own reason and fix, where it gives one
                backend.check(device, case.torch_dtype)
            except BackendUnavailableError as exc:
                return f"backend {name!r}: {exc}"
            return (
                f"backend {name!r} does not run on {device.type} (it declares {list(caps.devices)})"
            )
        if case.dtype not in caps.dtypes:
            return f"backend {name!r} does not take {case.dtype} (it declares {list(caps.dtypes)})"
        try:
            backend.check(device, case.torch_dtype)
        except BackendUnavailableError as exc:
            return str(exc)
        return None

    def build(case: Case) -> Fn:
        from fusedhead.api import FusedHead

        head = FusedHead(backend=name, options=options, device=case.device)
        temperature = case.temperature
        if case.head != heads.DEFAULT:
            return heads.build(case.head, case, head, temperature, IGNORE_INDEX)

        def fn(
            h: torch.Tensor, w: torch.Tensor, y: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            out = head(h, w, y, temperature=temperature, ignore_index=IGNORE_INDEX)
            return out.log_probs, out.entropy

        return fn

    dist = cand.distribution
    return Impl(
        label, spec, "backend", True, availability, build, (dist,) if dist else (), options=options
    )


def _broken(name: str, spec: str, error: BackendError, distribution: str | None) -> Impl:
    """An installed backend that does not load: every case reports ``error`` (its class and
    message, once)."""

    def fail(case: Case) -> Any:
        raise error.with_traceback(None)  # the same error on each case, its traceback fresh

    dists = (distribution,) if distribution else ()
    return Impl(name, spec, "backend", True, fail, fail, dists, note="does not load")


# --- peers --------------------------------------------------------------------------------------


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: assume it fits


def reference_estimate_bytes(case: Case) -> int:
    """Rough peak of the full-logits reference's forward + backward."""
    logits = case.n * case.vocab
    return int(logits * (4 * REFERENCE_LOGIT_COPIES + ELEMENT_BYTES[case.dtype]))


def full_logits(
    h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive full logits: a matmul in the input dtype, fp32 log-softmax and entropy, autograd."""
    if h.dtype in (torch.float32, torch.float64):
        from fusedhead.reference import reference_fused_head

        lp, ent = reference_fused_head(h, w, y, temperature=temperature, ignore_index=IGNORE_INDEX)
        assert ent is not None
        return lp, ent
    z = (h @ w.T).float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    valid = y != IGNORE_INDEX
    safe = torch.where(valid, y, torch.zeros_like(y))
    lp = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def _reference() -> Impl:
    def availability(case: Case) -> str | None:
        need = reference_estimate_bytes(case)
        free = _free_bytes(torch.device(case.device))
        if need > REFERENCE_FREE_FRACTION * free:
            return (
                f"full logits would need about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free "
                f"(limit {REFERENCE_FREE_FRACTION:.0%} of free)"
            )
        return None

    def build(case: Case) -> Fn:
        t = case.temperature
        return lambda h, w, y: full_logits(h, w, y, t)

    return Impl(
        "reference",
        "reference",
        "peer",
        True,
        availability,
        build,
        note="full fp32 logits from a matmul in the input dtype, autograd",
    )


def _liger_missing() -> str | None:
    if not _installed("liger_kernel"):
        return "liger-kernel is not installed (pip install liger-kernel)"
    return None


def _verl_chunked() -> Impl:
    def availability(case: Case) -> str | None:
        missing = _liger_missing()
        if missing:
            return missing
        try:
            importlib.import_module(_LIGER_MODULE)._FusedLinearPPOFallbackFunction  # noqa: B018
        except Exception as exc:
            return (
                f"liger-kernel has no _FusedLinearPPOFallbackFunction: {type(exc).__name__}: {exc}"
            )
        return None

    def build(case: Case) -> Fn:
        function = importlib.import_module(_LIGER_MODULE)._FusedLinearPPOFallbackFunction
        t = case.temperature

        def fn(
            h: torch.Tensor, w: torch.Tensor, y: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            nll, ent = function.apply(h, w, y, t, IGNORE_INDEX, True)
            return -nll, ent.float()

        return fn

    return Impl(
        "verl-chunked",
        "verl-chunked",
        "peer",
        True,
        availability,
        build,
        ("liger-kernel",),
        note="verl's 512-row chunked algorithm (liger-kernel _FusedLinearPPOFallbackFunction); entropy in the input dtype",
    )


def _liger_direct() -> Impl:
    def availability(case: Case) -> str | None:
        missing = _liger_missing()
        if missing:
            return missing
        device = torch.device(case.device)
        if device.type != "cuda" or torch.version.hip is not None:
            return "Liger runs its own kernel on NVIDIA SM90 only; here it would run the chunked fallback (= verl-chunked)"
        cap = torch.cuda.get_device_capability(device)
        if cap != (9, 0):
            return f"compute capability {cap[0]}.{cap[1]}: Liger would run its chunked fallback (= verl-chunked)"
        if case.dtype != "bf16":
            return f"Liger's SM90 kernel takes bf16 only (case is {case.dtype})"
        try:
            importlib.import_module(_LIGER_SM90_MODULE)
        except Exception as exc:
            return f"Liger's SM90 kernel does not import (CuTe DSL missing?): {type(exc).__name__}: {exc}"
        return None

    def build(case: Case) -> Fn:
        function = importlib.import_module(_LIGER_MODULE).LigerFusedLinearScaledCrossEntropyFunction
        t = case.temperature

        def fn(
            h: torch.Tensor, w: torch.Tensor, y: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            nll, ent = function.apply(h, w, y, t, IGNORE_INDEX, 1, True)
            return -nll, ent.float()

        return fn

    return Impl(
        "liger-direct",
        "liger-direct",
        "peer",
        True,
        availability,
        build,
        ("liger-kernel", "nvidia-cutlass-dsl"),
        note="liger-kernel's public LigerFusedLinearScaledCrossEntropyFunction (SM90 CuTe kernel); entropy in bf16",
    )


def _cce() -> Impl:
    def availability(case: Case) -> str | None:
        if not _installed("cut_cross_entropy"):
            return "cut-cross-entropy is not installed (pip install cut-cross-entropy)"
        if torch.device(case.device).type != "cuda":
            return "Cut Cross-Entropy's kernels run on CUDA only"
        try:
            importlib.import_module("cut_cross_entropy")
        except Exception as exc:
            return f"cut_cross_entropy does not import: {type(exc).__name__}: {exc}"
        return None

    def build(case: Case) -> Fn:
        lce = importlib.import_module("cut_cross_entropy").linear_cross_entropy
        t = case.temperature

        def fn(
            h: torch.Tensor, w: torch.Tensor, y: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            loss = lce(h / t, w, y, ignore_index=IGNORE_INDEX, reduction="none")
            return -loss.float(), None

        return fn

    return Impl(
        "cce",
        "cce",
        "peer",
        False,
        availability,
        build,
        ("cut-cross-entropy",),
        note="Apple's Cut Cross-Entropy linear_cross_entropy, defaults; no entropy (temperature applied as hidden / T)",
    )


_PEER_FACTORIES: dict[str, Callable[[], Impl]] = {
    "reference": _reference,
    "verl-chunked": _verl_chunked,
    "liger-direct": _liger_direct,
    "cce": _cce,
}


def _peer_installed(name: str) -> bool:
    if name in ("verl-chunked", "liger-direct"):
        return _installed("liger_kernel")
    if name == "cce":
        return _installed("cut_cross_entropy")
    return True


# --- resolution ---------------------------------------------------------------------------------


def parse_spec(spec: str, given: str | None = None) -> tuple[str, dict[str, Any]]:
    """``NAME`` or ``NAME:{json options}`` into the name and the options; an error names
    ``given``, the ``--impl`` value as written (default ``spec``, of which it may be a part)."""
    given = spec if given is None else given
    name, sep, raw = spec.partition(":")
    name = name.strip()
    if not sep:
        return name, {}
    try:
        options = load_json(raw)
    except ValueError as exc:  # malformed, or a key given twice
        raise ValueError(
            f"--impl {given!r}: options after ':' must be a JSON object ({exc})"
        ) from exc
    if not isinstance(options, dict):
        raise ValueError(
            f"--impl {given!r}: options after ':' must be a JSON object, got a JSON "
            f"{json_type(options)}"
        )
    return name, options


def resolve(spec: str, given: str | None = None) -> Impl:
    """The implementation named by ``spec``; an unknown name is a ValueError listing what exists.
    Errors name ``given``, the ``--impl`` value as written (default ``spec``)."""
    given = spec if given is None else given
    if spec.startswith(UNFUSED):
        return _unfused(spec, given)
    name, options = parse_spec(spec, given)
    if name in _PEER_FACTORIES:
        if options:
            raise ValueError(f"--impl {given!r}: peer {name!r} takes no options")
        return _peer_cases(_PEER_FACTORIES[name]())
    installed = list(registry.candidates())
    if name not in installed:
        from fusedhead.checks import did_you_mean
        from fusedhead.registry import unknown_name_message

        raise ValueError(
            f"unknown implementation {name!r} for --impl: it is neither a fusedhead backend this "
            f"process can name nor a peer ({', '.join(PEERS)}){did_you_mean(name, PEERS) or '.'} "
            + unknown_name_message(name, installed)
        )
    return _backend(name, options, spec)


def _peer_cases(impl: Impl) -> Impl:
    """A peer measured on the ``logprobs`` case (the issue-18 cases are fusedhead calls) and, where
    it computes entropy, on the ``policy`` case: its log-probs and entropy, then the loss in torch."""
    available, build = impl.availability, impl.build

    def availability(case: Case) -> str | None:
        if case.head == policy.NAME and not impl.entropy:
            return f"peer {impl.name!r} computes no entropy, which the policy loss's bonus needs"
        if case.head not in (heads.DEFAULT, policy.NAME):
            return (
                f"peer {impl.name!r} computes the logprobs and policy cases only, not {case.head!r}"
            )
        return available(case)

    def build_case(case: Case) -> Fn:
        if case.head == policy.NAME:
            return policy.unfused(case, build(case))
        return build(case)

    impl.availability, impl.build = availability, build_case
    return impl


#: ``unfused:NAME`` (or ``unfused:NAME:{json options}``): a backend's log-probs and entropy, then
#: the policy loss in torch (the four-GEMM path the ``policy`` case compares the fused loss with).
UNFUSED = "unfused:"


def _unfused(spec: str, given: str) -> Impl:
    """``unfused:NAME``: the backend's ``logprobs`` head, then ``policy.loss_from_stats``; an
    error names ``given``, the ``--impl`` value as written."""
    rest = spec[len(UNFUSED) :]
    if rest.partition(":")[0].strip() == UNFUSED.rstrip(":"):
        raise ValueError(
            f"--impl {given!r}: {UNFUSED} is given twice; it takes an installed fusedhead "
            f"backend's name (e.g. {UNFUSED}triton), not another {UNFUSED}NAME"
        )
    name, _ = parse_spec(rest, given)
    if not name or name in _PEER_FACTORIES:
        raise ValueError(
            f"--impl {given!r}: unfused: takes an installed fusedhead backend's name "
            f"(e.g. unfused:triton), got {name!r}"
        )
    inner = resolve(rest, given)

    def availability(case: Case) -> str | None:
        if case.head != policy.NAME:
            return f"{spec!r} runs the policy case only (a head's log-probs, then the loss), not {case.head!r}"
        return inner.availability(dataclasses.replace(case, head=heads.DEFAULT))

    def build(case: Case) -> Fn:
        stats = inner.build(dataclasses.replace(case, head=heads.DEFAULT))
        return policy.unfused(case, stats)

    return Impl(
        f"{UNFUSED}{inner.name}",
        spec,
        "backend",
        True,
        availability,
        build,
        inner.distributions,
        note="the backend's log-probs and entropy, then the policy loss in torch (four GEMMs)",
        options=inner.options,
    )


def default_specs(heads_asked: Iterable[str] = ()) -> list[str]:
    """Every installed backend with its default options, then every peer whose package is
    installed; with the ``policy`` case among ``heads_asked``, each backend's unfused path too
    (its log-probs, then the loss in torch), the four-GEMM path the fused loss is weighed against."""
    backends = list(registry.candidates())
    unfused = [f"{UNFUSED}{b}" for b in backends] if policy.NAME in heads_asked else []
    return [*backends, *unfused, *(p for p in PEERS if _peer_installed(p))]


def environment_note() -> dict[str, str]:
    """Environment variables that change what backends do (recorded with each result)."""
    keys = ("TRITON_INTERPRET", "FUSEDHEAD_BACKENDS", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
    return {k: os.environ[k] for k in keys if k in os.environ}
