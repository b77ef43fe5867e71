"""VeOmni (tested with 0.1.12): ``cross_entropy_loss_implementation: fusedhead:<name>``.

VeOmni selects its kernels by name from ``model.ops_implementation`` through a real registry:
``KERNEL_REGISTRY.register(KernelSpec(...))`` entries, resolved into the ``OpSlot``s of its
generated modeling code by ``build_foundation_model``. fusedhead registers one
``cross_entropy_loss`` kernel per installed backend there, named ``fusedhead:<name>`` (variant
``causal``; variant ``seq_cls`` gets VeOmni's eager sequence-classification loss, as its own
``chunk_loss`` does). The kernel serves both of VeOmni's paths: the loss, and per-token
log-probs and entropy (``return_log_probs=True``, VeOmni's DPO trainer and verl's VeOmni engine),
with ``shift_labels`` used verbatim, as ``chunk_logprobs_function`` does.

One thing the registry cannot do: ``apply_ops_config`` first calls
``veomni.ops.kernels.cross_entropy.install_loss_mapping``, which accepts only VeOmni's built-in
names and raises for any other. :func:`install` therefore wraps that one public function
(opt-in: nothing happens until you call it): fusedhead names install fusedhead's loss into
``LOSS_MAPPING``, every other name goes to VeOmni's own function. Unknown fusedhead names raise
``UnknownBackendError`` listing what is installed; the backend resolves (and the
``fusedhead_backend_resolved`` provenance hook fires) inside ``build_foundation_model``.
Nothing here imports VeOmni or torch at import time.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "OP_NAME",
    "fusedhead_causal_lm_loss",
    "install",
    "is_installed",
    "register",
    "uninstall",
]

#: VeOmni's op whose ``{op}_implementation`` config field selects the kernel.
OP_NAME = "cross_entropy_loss"

_lock = threading.Lock()
_original: dict[str, Callable[..., Any]] = {}
#: The ``LOSS_MAPPING`` entries before a fusedhead name first replaced them (None: absent), and
#: what fusedhead put there last: ``uninstall`` puts an entry back only while it is still ours.
_replaced: dict[str, Any] = {}
_ours: dict[str, Any] = {}


def _installed_names() -> list[str]:
    from fusedhead import diagnostics

    return sorted({row.name for row in diagnostics.listing()})


#: The VeOmni setting that names the kernel, as its config spells it.
SETTING = "cross_entropy_loss_implementation"


def _resolve(spec: str) -> Any:
    """The head ``spec`` names; a malformed or unknown name is reported as the setting's value."""
    from fusedhead.integrations.backend_spec import resolve_lm_head

    return resolve_lm_head(spec, setting=SETTING)


def _causal_factory(spec: str) -> Callable[..., Any]:
    """What ``KERNEL_REGISTRY.resolve`` returns for ``spec``: the loss bound to its head."""
    return functools.partial(fusedhead_causal_lm_loss, head=_resolve(spec))


class _NamedLoss:
    """fusedhead's causal-LM loss bound to a head, named ``spec``: VeOmni's ops summary prints a
    ``LOSS_MAPPING`` entry's name (a partial's read as ``cross_entropy = unset``)."""

    def __init__(self, spec: str) -> None:
        self.__name__ = spec
        self.loss = _causal_factory(spec)  # resolves: unknown names raise here

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.loss(*args, **kwargs)


def _check_runs_here(spec: str) -> None:
    """Fail where the config is applied, not at the first forward: the backend must run on the
    device VeOmni trains on (``veomni.utils.device.get_device_type``), named with the setting."""
    from veomni.utils.device import get_device_type

    from fusedhead.integrations.backend_spec import check_head_runs_on

    check_head_runs_on(_resolve(spec), get_device_type(), setting=SETTING, value=spec)


def _seq_cls_factory() -> Callable[..., Any]:
    """Sequence classification has no per-token log-probs: VeOmni's eager wrapper, as chunk_loss."""
    from veomni.ops.kernels.cross_entropy import ForSequenceClassificationLoss, eager_cross_entropy

    return functools.partial(ForSequenceClassificationLoss, cross_entropy_fn=eager_cross_entropy)


def _register_spec(spec: str) -> bool:
    """Register ``spec`` under both variants unless present; True if it was added."""
    from veomni.ops.kernel_registry import KERNEL_REGISTRY, HardwareRequirement, KernelSpec

    if spec in KERNEL_REGISTRY.list_available(OP_NAME, "causal"):
        return False
    # The backend checks its own device; VeOmni's gate would only duplicate it.
    anywhere = HardwareRequirement(device_type="any")
    KERNEL_REGISTRY.register(
        KernelSpec(
            name=spec,
            op_name=OP_NAME,
            variant="causal",
            factory=functools.partial(_causal_factory, spec),
            hardware=anywhere,
            description=f"fusedhead backend {spec.partition(':')[2] or 'default'!r}: "
            "log-probs, entropy and loss without [tokens, vocab] logits",
        )
    )
    if spec not in KERNEL_REGISTRY.list_available(OP_NAME, "seq_cls"):
        KERNEL_REGISTRY.register(
            KernelSpec(
                name=spec,
                op_name=OP_NAME,
                variant="seq_cls",
                factory=_seq_cls_factory,
                hardware=anywhere,
                description="eager sequence-classification loss (fusedhead is causal-only)",
            )
        )
    return True


def register(names: Iterable[str] | None = None) -> list[str]:
    """Register ``fusedhead:<name>`` kernels in VeOmni's ``KERNEL_REGISTRY``; idempotent.

    ``names``: backend names (default: every installed fusedhead backend, from metadata, no
    import). Returns the specs added now. Registering resolves nothing: a backend is resolved
    when VeOmni binds the kernel (``build_foundation_model``).
    """
    from fusedhead.backend_names import NAME_PATTERN
    from fusedhead.integrations.backend_spec import SPEC_PREFIX

    if isinstance(names, (str, bytes)):  # iterated, it would register one kernel per character
        raise TypeError(f"names must be a list of backend names, got the str {names!r}")
    chosen = _installed_names() if names is None else list(names)
    added = []
    for name in chosen:
        if not isinstance(name, str):
            raise TypeError(f"names must be backend names (str), got {type(name).__name__}")
        if not NAME_PATTERN.match(name):
            raise ValueError(
                f"names: {name!r} is not a backend name ([a-z0-9_-]+, e.g. 'triton'; the kernel "
                f"is registered as '{SPEC_PREFIX}:<name>')"
            )
        spec = f"{SPEC_PREFIX}:{name}"
        if _register_spec(spec):
            added.append(spec)
    return added


def install() -> None:
    """Opt in: register the kernels and let ``install_loss_mapping`` accept fusedhead names.

    Call it once before ``build_foundation_model`` (a trainer script's first lines). Idempotent.
    """
    with _lock:
        from veomni.ops.kernels import cross_entropy

        register()
        current = cross_entropy.install_loss_mapping
        if current is not install_loss_mapping:
            _original["install_loss_mapping"] = current
            cross_entropy.install_loss_mapping = install_loss_mapping


def uninstall() -> None:
    """Put VeOmni's own ``install_loss_mapping`` back, and the ``LOSS_MAPPING`` entries a
    fusedhead name replaced (registered kernels stay registered; a model VeOmni built with a
    fusedhead kernel keeps it)."""
    with _lock:
        original = _original.pop("install_loss_mapping", None)
        if original is not None:
            from veomni.ops.kernels import cross_entropy

            cross_entropy.install_loss_mapping = original
        if _replaced:
            from transformers.loss.loss_utils import LOSS_MAPPING

            for key, value in _replaced.items():
                if LOSS_MAPPING.get(key) is not _ours.get(key):
                    continue  # set since by VeOmni (another model's kernel): left as it is
                if value is None:
                    LOSS_MAPPING.pop(key, None)
                else:
                    LOSS_MAPPING[key] = value
            _replaced.clear()
            _ours.clear()


def is_installed() -> bool:
    """True when VeOmni's ``install_loss_mapping`` is fusedhead's wrapper."""
    import sys

    module = sys.modules.get("veomni.ops.kernels.cross_entropy")
    return getattr(module, "install_loss_mapping", None) is install_loss_mapping


def install_loss_mapping(impl: str = "eager") -> str:
    """VeOmni's ``install_loss_mapping`` plus ``fusedhead[:<name>]``; other names go to VeOmni.

    For a fusedhead name: the backend is resolved (unknown: ``UnknownBackendError``), the name
    is registered if it was not (``fusedhead`` alone, or a backend registered after
    :func:`install`), and ``LOSS_MAPPING`` gets fusedhead's loss for ``ForCausalLM`` and
    ``ForConditionalGeneration`` and VeOmni's eager loss for ``ForSequenceClassification``.
    """
    from fusedhead.integrations.backend_spec import is_fusedhead_spec, is_misspelt_spec

    if is_misspelt_spec(impl):  # VeOmni's own error would list its names only
        ours = ", ".join(f"'fusedhead:{n}'" for n in _installed_names()) or "none installed"
        raise ValueError(
            f"cross_entropy_loss_implementation={impl!r} looks meant for fusedhead but is not its "
            f"spelling; fusedhead's: 'fusedhead', {ours} (VeOmni's own names are unchanged)"
        )
    if not is_fusedhead_spec(impl):
        original = _original.get("install_loss_mapping")
        if original is None:
            from veomni.ops.kernels import cross_entropy

            original = cross_entropy.install_loss_mapping
            if original is install_loss_mapping:  # pragma: no cover - defensive
                raise RuntimeError("VeOmni's own install_loss_mapping was lost")
        label: str = original(impl)
        return label
    from transformers.loss.loss_utils import LOSS_MAPPING

    causal = _NamedLoss(impl)  # resolves: unknown names raise here
    _check_runs_here(impl)
    _register_spec(impl)
    entries: dict[str, Callable[..., Any]] = {
        "ForCausalLM": causal,
        "ForConditionalGeneration": causal,
        "ForSequenceClassification": _seq_cls_factory(),
    }
    with _lock:
        for key, value in entries.items():
            if LOSS_MAPPING.get(key) is not _ours.get(key) or key not in _replaced:
                _replaced[key] = LOSS_MAPPING.get(key)  # VeOmni's (or transformers') entry
            LOSS_MAPPING[key] = _ours[key] = value
    return f"CrossEntropy ({impl})"


def _weight_holder(weights: Any) -> Any:
    """A module around VeOmni's ``weights`` tensor so ``lm_head_logprobs`` can read it."""
    from torch import nn

    if any(c.__name__ == "DTensor" for c in type(weights).__mro__):
        raise RuntimeError(
            "VeOmni passed the LM-head weight as a DTensor shard: its modeling code reads "
            "self.lm_head.weight in the root's forward, which is unsharded only while lm_head "
            "belongs to the root FSDP unit (VeOmni's parallelize_model_fsdp2 keeps it there); "
            "do not fully_shard lm_head on its own with fusedhead's VeOmni kernel"
        )
    holder = nn.Module()
    object.__setattr__(holder, "weight", weights)  # not a Parameter of the holder: no copy
    return holder


def fusedhead_causal_lm_loss(
    logits: Any = None,
    labels: Any = None,
    vocab_size: int | None = None,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: Any = None,
    *,
    head: Any,
    hidden_states: Any = None,
    weights: Any = None,
    return_log_probs: bool = False,
    temperature: Any = 1.0,
    teacher_topk_ids: Any = None,
    teacher_topk_log_probs: Any = None,
    log_prob_min_clamp: float | None = None,
    **kwargs: Any,
) -> tuple[Any, Any, Any]:
    """VeOmni's causal-LM loss contract, ``(loss, logits, fused_linear_aux)``, from fusedhead.

    ``return_log_probs=True``: ``(None, None, FusedLinearAuxOutput(log_probs, entropy))``,
    fp32, the shape of ``shift_labels`` when given (used verbatim), else of ``labels`` with the
    causal shift applied here and a 0 in the last slot (none under sequence parallelism, whose
    collator shifted already); ``ignore_index`` rows give 0. With ``teacher_topk_ids`` and
    ``teacher_topk_log_probs`` (verl's VeOmni engine with top-k distillation) the aux output
    also holds ``distillation_losses``, ``student_mass`` and ``teacher_mass`` as VeOmni's
    ``chunk_topk_distill_function`` computes them (``log_prob_min_clamp`` included), the
    student's top-k log-probs gathered by the backend (``gather_ids``).
    Otherwise ``(loss, None, None)``: the mean negative log-likelihood of the shifted labels
    (over ``num_items_in_batch`` when given), reduced across the sequence-parallel group as
    VeOmni's ``ForCausalLMLoss`` does; teacher tensors are ignored there, as VeOmni ignores them.
    """
    import torch
    from veomni.distributed.parallel_state import get_parallel_state
    from veomni.utils.model_outputs import FusedLinearAuxOutput

    from fusedhead.integrations.lm_head import lm_head_logprobs

    teacher_ids, teacher_log_probs = teacher_topk_ids, teacher_topk_log_probs
    if hidden_states is None or weights is None:
        raise ValueError(
            "fusedhead's VeOmni kernel needs hidden_states= and weights= (VeOmni's patched "
            f"modeling code passes them), got hidden_states={type(hidden_states).__name__}, "
            f"weights={type(weights).__name__}"
        )
    if labels is None and shift_labels is None:
        raise ValueError("fusedhead's VeOmni kernel needs labels= or shift_labels=, got neither")
    if return_log_probs:  # the loss path ignores the temperature and the teacher, as VeOmni's
        _check_kernel_args(
            labels, shift_labels, ignore_index, temperature, teacher_ids, teacher_log_probs,
            log_prob_min_clamp,
        )  # fmt: skip
    else:
        _check_kernel_args(labels, shift_labels, ignore_index, 1.0, None, None, None)
    lm_head = _weight_holder(weights)
    sp_enabled = bool(get_parallel_state().sp_enabled)
    if return_log_probs:
        if (teacher_ids is None) != (teacher_log_probs is None):
            raise ValueError(  # VeOmni's own message and type
                "teacher_topk_ids and teacher_topk_log_probs must be provided together for "
                "the top-k distillation path."
            )
        pad = shift_labels is None and not sp_enabled
        if shift_labels is not None:
            hidden, target = hidden_states, shift_labels
        elif sp_enabled:
            hidden, target = hidden_states, labels
        else:
            hidden, target = hidden_states[..., :-1, :], labels[..., 1:]
            if teacher_ids is not None:  # aligned with the labels: the same causal shift
                teacher_ids, teacher_log_probs = (
                    teacher_ids[..., 1:, :],
                    teacher_log_probs[..., 1:, :],
                )
        out = lm_head_logprobs(
            lm_head,
            hidden,
            target.to(torch.int64),
            head=head,
            temperature=float(temperature),  # checked: a positive real number
            ignore_index=ignore_index,
            gather_ids=None if teacher_ids is None else teacher_ids.to(torch.int64),
        )
        fields: dict[str, Any] = {"log_probs": out.log_probs, "entropy": out.entropy}
        if teacher_ids is not None:
            fields.update(
                _topk_distillation(
                    out.gathered,
                    teacher_log_probs,
                    target != ignore_index,
                    log_prob_min_clamp,
                    teacher_ids != ignore_index,
                )
            )
        if pad:
            fields = {k: torch.nn.functional.pad(v, (0, 1), value=0.0) for k, v in fields.items()}
        return None, None, FusedLinearAuxOutput(**fields)

    # The loss path ignores teacher tensors, as VeOmni's ForCausalLMLoss does.
    if sp_enabled:
        target = labels  # the sequence-parallel collator shifted them
    elif shift_labels is not None:
        target = shift_labels
    else:
        target = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    log_probs, _ = lm_head_logprobs(
        lm_head,
        hidden_states,
        target.to(hidden_states.device, torch.int64),
        head=head,
        ignore_index=ignore_index,
        return_entropy=False,
    )
    total = -log_probs.sum()
    if num_items_in_batch is None:
        loss = total / (target != ignore_index).sum()
    else:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        loss = total / num_items_in_batch
    if sp_enabled:
        from veomni.distributed.sequence_parallel import reduce_sequence_parallel_loss

        loss = reduce_sequence_parallel_loss(loss, (labels != ignore_index).sum())
    return loss, None, None


def _check_kernel_args(
    labels: Any,
    shift_labels: Any,
    ignore_index: Any,
    temperature: Any,
    teacher_ids: Any,
    teacher_log_probs: Any,
    clamp: Any,
) -> None:
    """The kernel's arguments as VeOmni documents them, each refused by name otherwise (a float
    label was truncated to an id; a str temperature or clamp failed inside torch)."""
    import numbers

    import torch

    from fusedhead.checks import positive_float

    for arg, value in (("labels", labels), ("shift_labels", shift_labels), ("teacher_topk_ids", teacher_ids)):  # fmt: skip
        if value is not None and (
            not isinstance(value, torch.Tensor)
            or value.is_floating_point()
            or value.is_complex()
            or value.dtype == torch.bool
        ):
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"{arg} must be an integer tensor of token ids, got {got}")
    if ignore_index.__class__ is bool or not isinstance(ignore_index, int):
        raise TypeError(
            f"ignore_index must be an int, got {type(ignore_index).__name__} {ignore_index!r}"
        )
    positive_float("temperature", temperature)
    if clamp is not None and (clamp.__class__ is bool or not isinstance(clamp, numbers.Real)):
        raise TypeError(
            f"log_prob_min_clamp must be a number or None, got {type(clamp).__name__} {clamp!r}"
        )
    if teacher_ids is not None and teacher_log_probs is not None:
        if (
            not isinstance(teacher_log_probs, torch.Tensor)
            or not teacher_log_probs.is_floating_point()
        ):
            raise TypeError("teacher_topk_log_probs must be a floating-point tensor")
        if teacher_log_probs.shape != teacher_ids.shape:
            raise ValueError(
                f"teacher_topk_log_probs of shape {tuple(teacher_log_probs.shape)} must match "
                f"teacher_topk_ids' {tuple(teacher_ids.shape)}"
            )


def _topk_distillation(
    student: Any, teacher: Any, scored: Any, clamp: float | None, real: Any
) -> dict[str, Any]:
    """VeOmni's top-k forward KL from the student's log-probs at the teacher's top-k ids.

    The formula of ``chunk_topk_distill_function``: ``sum_k p_t (log p_t - log q_s)`` on
    ``log_prob_min_clamp``-clamped log-probs, the masses before the clamp (detached metrics),
    every output 0 on ignored rows. A slot whose id is ``ignore_index`` (``real`` False: a row
    with fewer than k teacher ids, padded) adds nothing to any of them (VeOmni refuses such an
    id; its gathered 0 is no probability of 1, and its teacher value may be -inf).
    """
    import torch

    zero = torch.zeros((), dtype=torch.float32, device=student.device)
    student_mass = torch.where(scored, torch.where(real, student.exp(), 0).sum(-1), zero)
    teacher_mass = torch.where(scored, torch.where(real, teacher.exp(), 0).sum(-1).float(), zero)
    student_mass, teacher_mass = student_mass.detach(), teacher_mass.detach()
    if clamp is not None:
        student, teacher = student.clamp_min(clamp), teacher.clamp_min(clamp)
    teacher = teacher.float()
    kl = torch.where(real, teacher.exp() * (teacher - student.float()), 0).sum(-1)
    return {
        "distillation_losses": torch.where(scored, kl, zero),
        "student_mass": student_mass,
        "teacher_mass": teacher_mass,
    }
