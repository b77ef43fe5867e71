"""The plugin API (version 2): what a backend distribution implements, and what it declares.

A backend is a class registered under the entry-point group ``fusedhead.backends``; the
entry-point name is the backend name. The core validates every call and hands the backend one
frozen :class:`HeadCall` (2-D ``hidden [N, H]``, ``weight [V_local, H]`` of one dtype and device,
1-D int64 ``labels [N]``, resolved shard bounds, the requested outputs); the backend returns one
:class:`HeadOutput`. New outputs become new fields of both, never a new signature.

Version 1 (a 13-argument ``forward``) is refused with ``IncompatibleBackendError``: no v1 backend
was ever published outside this repository, so 1.x carries no shim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

if TYPE_CHECKING:
    import torch

#: Version of the plugin API this core speaks. A backend declares ``plugin_api_version``.
PLUGIN_API_VERSION = 2
#: Inclusive window of plugin API versions this core can load.
SUPPORTED_PLUGIN_API = (2, 2)

Precision = Literal["fp32", "fp16", "bf16"]
DTypeName = Literal["fp32", "fp16", "bf16"]

#: Outputs a call may request. ``log_probs`` is always computed. ``lse``: the log-sum-exp of the
#: scaled logits (z-loss); ``sum_p2``: the sum of squared probabilities; ``argmax``: the most
#: likely id (token accuracy); ``topk``: the ``top_k`` most likely ids and their log-probs;
#: ``gather``: the log-probs at ``gather_ids``.
OUTPUTS: tuple[str, ...] = ("log_probs", "entropy", "lse", "sum_p2", "argmax", "topk", "gather")
#: The ``HeadOutput`` fields each output fills.
OUTPUT_FIELDS: dict[str, tuple[str, ...]] = {
    "log_probs": ("log_probs",),
    "entropy": ("entropy",),
    "lse": ("lse",),
    "sum_p2": ("sum_p2",),
    "argmax": ("argmax",),
    "topk": ("topk_ids", "topk_log_probs"),
    "gather": ("gathered",),
}
#: Directions of the per-token KL between two heads: forward ``KL(p_teacher || p_student)``,
#: reverse ``KL(p_student || p_teacher)``.
KL_DIRECTIONS: tuple[str, ...] = ("forward", "reverse")
#: ``aggregation`` of the policy loss: verl's ``loss_agg_mode`` values.
AGGREGATIONS: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
#: ``kl_estimator`` of the policy loss's KL penalty against a reference policy: verl's k1, k2, k3
#: (``low_var_kl``, clamped) and abs; k1+, k3+ and abs+, verl's straight-through forms (the value,
#: the gradient of k2); k3-unclamped, TRL's GRPO KL (``exp(d) - d - 1`` without verl's
#: clamps). Backends take each term's derivative from ``fusedhead.policy_terms.token_grads``.
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+", "k3-unclamped")
#: The smallest ``tis_cap`` taken (a cap of importance weights, compared in fp32), and how a
#: refusal states the bound.
TIS_CAP_FLOOR = 1e-30
TIS_CAP_TEXT = "a finite float >= 1e-30 (a cap of the importance weights)"
#: The range of a call's float scalars (``temperature``, ``softcap`` and the KL's teacher ones,
#: per-token temperatures included), checked by the core: 2**-126 to 2**126, where the value and
#: its reciprocal are both normal fp32 numbers, so a backend may take ``1 / temperature`` or
#: ``z / softcap`` in fp32 without overflowing to inf or flushing to 0.
SCALAR_RANGE: tuple[float, float] = (2.0**-126, 2.0**126)


class Capabilities(BaseModel):
    """What a backend can do on one device; checked against ``require=[...]`` and the call."""

    model_config = ConfigDict(extra="allow", frozen=True)

    devices: tuple[str, ...] = ("cpu",)
    dtypes: tuple[DTypeName, ...] = ("fp32", "fp16", "bf16")
    #: Outputs the backend computes (``log_probs`` always); a call asking for another is refused.
    outputs: tuple[str, ...] = ("log_probs", "entropy")
    vocab_parallel: StrictBool = False
    #: Forward and backward give the same bits run to run.
    deterministic: StrictBool = False
    #: A row's forward outputs do not depend on the other rows of the batch or on N.
    batch_invariant: StrictBool = False
    #: Coarsest precision in which entropy is computed before being returned in fp32. A backend that
    #: computes "in the input dtype" declares the coarsest it accepts; tolerances (conformance kit)
    #: use the finer of this and the input dtype.
    entropy_precision: Precision = "fp32"
    #: Coarsest precision in which logits are materialised inside the backend; read like
    #: ``entropy_precision`` (the finer of it and the input dtype applies).
    logits_precision: Precision = "fp32"
    #: ``temperature`` may be a tensor broadcastable to the labels' shape.
    per_token_temperature: StrictBool = False
    #: Smallest temperature (a float or any per-token value, either head of the KL) the backend
    #: computes to its declared precision; the core refuses a smaller one by name (per-token
    #: values within the call's checked read: ``check_labels``). Default: the core's own floor.
    min_temperature: float = Field(default=2.0**-126, ge=2.0**-126, le=2.0**126)
    #: ``softcap=c`` applies ``c * tanh(z / c)`` before the temperature division.
    softcap: StrictBool = False
    #: Vocabulary shards may have unequal sizes under ``process_group``.
    uneven_shards: StrictBool = False
    #: Outputs the backend also computes under ``process_group`` (a subset of ``outputs``).
    vocab_parallel_outputs: tuple[str, ...] = ("log_probs", "entropy")
    #: Largest ``top_k`` the backend takes (when it declares the ``topk`` output).
    max_top_k: int = 0
    #: KL directions ``kl(KLCall)`` computes; empty: the backend has no two-head KL.
    kl_directions: tuple[str, ...] = ()
    #: ``policy_loss(PolicyLossCall)``: the RL policy loss's gradients computed in the forward
    #: (three GEMMs per token chunk; docs/policy-loss.md). A backend without it is refused by name.
    policy_loss: StrictBool = False
    #: Vocab-parallel results are the one-process bits at any tensor-parallel degree where every
    #: shard starts on a multiple of ``vocab_grid`` (docs/vocab-parallel.md).
    degree_invariant: StrictBool = False
    #: The vocabulary grid of ``degree_invariant``, in columns (0: none declared).
    vocab_grid: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> Capabilities:
        """Declarations that contradict each other are refused when the backend builds them."""
        if "log_probs" not in self.outputs:
            raise ValueError(
                f"outputs must include 'log_probs' (every call returns it), got {self.outputs}"
            )
        # Names the core knows: a misspelt one ("arg_max") would read as "not declared" and its
        # kit property as "not run", silently.
        for arg, names, known in (
            ("outputs", self.outputs, OUTPUTS),
            ("vocab_parallel_outputs", self.vocab_parallel_outputs, OUTPUTS),
            ("kl_directions", self.kl_directions, ("forward", "reverse")),
        ):
            unknown = [n for n in names if n not in known]
            if unknown:
                raise ValueError(f"{arg} must be among {list(known)}, got {unknown}")
        import torch  # at run time only here: the module is read before torch is needed

        for name in self.devices:
            try:
                torch.device(name)
            except (RuntimeError, TypeError):
                raise ValueError(
                    f"devices must be torch device types ('cpu', 'cuda', ...), got {name!r}"
                ) from None
        if self.degree_invariant and (not self.vocab_parallel or self.vocab_grid < 1):
            raise ValueError(
                "degree_invariant needs vocab_parallel and the grid it holds on (vocab_grid >= "
                f"1), got vocab_parallel={self.vocab_parallel}, vocab_grid={self.vocab_grid}"
            )
        if "topk" in self.outputs and self.max_top_k < 1:
            raise ValueError(
                f"outputs include 'topk', so max_top_k must be the largest k taken (>= 1), "
                f"got {self.max_top_k}"
            )
        return self


#: Boolean capability names that ``require=[...]`` may ask for.
REQUIRABLE_CAPABILITIES: frozenset[str] = frozenset(
    name for name, field in Capabilities.model_fields.items() if field.annotation in (bool, "bool")
)


class NoOptions(BaseModel):
    """Options model for a backend that takes none."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class HeadCall(NamedTuple):
    """One validated call, as every backend receives it (immutable; cheap to build per call)."""

    hidden: torch.Tensor  #: [N, H]
    weight: torch.Tensor  #: [V_local, H], hidden's dtype and device
    labels: torch.Tensor  #: [N] int64, contiguous; ``ignore_index`` rows give 0
    temperature: float | torch.Tensor  #: a float > 0, or fp32 [N] (never differentiated)
    softcap: float | None  #: ``c * tanh(z / c)`` before the temperature division
    ignore_index: int
    vocab_start: int  #: first global vocabulary id of ``weight``'s rows
    vocab_size: int  #: the global vocabulary size (``V_local`` without a process group)
    process_group: Any  #: None, or the group the vocabulary is sharded over
    reduce_hidden_grad: bool  #: all-reduce the hidden gradient over ``process_group``
    outputs: frozenset[str]  #: requested outputs, a subset of :data:`OUTPUTS`
    top_k: int = 0  #: ids per row of the ``topk`` output (> 0 exactly when it is requested)
    #: int64 ``[N, K]`` global ids of the ``gather`` output (set exactly when it is requested)
    gather_ids: torch.Tensor | None = None

    @property
    def return_entropy(self) -> bool:
        """Whether the entropy was asked for."""
        return "entropy" in self.outputs

    @classmethod
    def make(
        cls,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float | torch.Tensor = 1.0,
        ignore_index: int = -100,
        return_entropy: bool = True,
        process_group: Any = None,
        vocab_start: int = 0,
        vocab_size: int | None = None,
        reduce_hidden_grad: bool = True,
        softcap: float | None = None,
        extras: frozenset[str] = frozenset(),
        top_k: int = 0,
        gather_ids: torch.Tensor | None = None,
    ) -> HeadCall:
        """A call with defaults, for a backend's own unit tests (the core validates real calls).

        ``extras`` names further outputs (``lse``, ``sum_p2``, ``argmax``); ``top_k > 0`` and
        ``gather_ids`` request ``topk`` and ``gather``.
        """
        extra_names = ("lse", "sum_p2", "argmax")
        if isinstance(extras, str) or not set(extras) <= set(extra_names):
            raise ValueError(
                f"extras must be a set of output names among {list(extra_names)}, got "
                f"{sorted(extras) if not isinstance(extras, str) else extras!r}"
            )
        outputs = {"log_probs", "entropy"} if return_entropy else {"log_probs"}
        outputs |= set(extras)
        if top_k:
            outputs.add("topk")
        if gather_ids is not None:
            outputs.add("gather")
        return cls(
            hidden=hidden,
            weight=weight,
            labels=labels,
            temperature=temperature,
            softcap=softcap,
            ignore_index=ignore_index,
            vocab_start=vocab_start,
            vocab_size=weight.shape[0] if vocab_size is None else vocab_size,
            process_group=process_group,
            reduce_hidden_grad=reduce_hidden_grad,
            outputs=frozenset(outputs),
            top_k=top_k,
            gather_ids=gather_ids,
        )


@dataclass(frozen=True)
class HeadOutput:
    """What ``forward`` returns: fp32 ``[N]`` tensors, differentiable in hidden and weight.

    A field is set exactly when its output was requested (``log_probs`` always).
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    lse: torch.Tensor | None = None  #: fp32 [N] log-sum-exp of the scaled logits
    sum_p2: torch.Tensor | None = None  #: fp32 [N] sum of squared probabilities
    argmax: torch.Tensor | None = None  #: int64 [N] most likely id (lower id on ties)
    topk_ids: torch.Tensor | None = None  #: int64 [N, k], most likely first, lower id on ties
    topk_log_probs: torch.Tensor | None = None  #: fp32 [N, k], differentiable
    gathered: torch.Tensor | None = None  #: fp32 [N, K] log-probs at ``gather_ids``


@dataclass(frozen=True)
class KLCall:
    """One validated two-head KL call: a student head and a teacher (or reference) head.

    Both heads share the vocabulary (``weight`` and ``teacher_weight`` have V rows); their hidden
    sizes may differ. Gradients reach the student (``hidden``, ``weight``) only.
    """

    hidden: torch.Tensor  #: student [N, H]
    weight: torch.Tensor  #: student [V, H]
    teacher_hidden: torch.Tensor  #: [N, H_t], the student's dtype and device
    teacher_weight: torch.Tensor  #: [V, H_t]
    valid: torch.Tensor  #: bool [N]; rows where it is False give 0
    temperature: float | torch.Tensor  #: the student's: a float > 0, or fp32 [N]
    teacher_temperature: float | torch.Tensor  #: the teacher's, likewise
    direction: str  #: one of :data:`KL_DIRECTIONS`
    #: The student's softcap ``c``: ``c * tanh(z / c)`` before its temperature division (None: none)
    softcap: float | None = None
    teacher_softcap: float | None = None  #: the teacher's, likewise


@dataclass(frozen=True)
class KLOutput:
    """What ``kl`` returns: the fp32 ``[N]`` per-token KL, differentiable in the student."""

    kl: torch.Tensor


@dataclass(frozen=True)
class PolicyLossCall:
    """One validated policy-loss call (docs/policy-loss.md): a head call and per-token terms.

    The loss is ``sum_i token_weight[i] * l_i`` with ``l_i`` the clipped surrogate (times the TIS
    weight), minus ``entropy_coef`` times the entropy, plus ``kl_coef`` times the KL estimate. Its
    derivative in each row's log-prob and entropy comes from
    :func:`fusedhead.policy_terms.token_grads` once the row's statistics are known, so a backend
    computes ``dz``, ``dX = dz W`` and ``dW = dz^T X`` in its forward. Per-token tensors are fp32
    ``[N]`` on the head's device; an ignored row (label ``ignore_index``) has weight 0 and any
    values in its other terms (NaN included).
    """

    head: HeadCall  #: hidden [N, H], weight [V, H], labels [N]; outputs log_probs and entropy
    #: fp32 [N]; None: on-policy, the old policy is the current one (ratio exactly 1, as
    #: ``exp(lp - lp.detach())``): :func:`fusedhead.policy_terms.token_grads` handles it
    old_log_probs: torch.Tensor | None
    advantages: torch.Tensor  #: fp32 [N]
    token_weight: torch.Tensor  #: fp32 [N], the aggregation's weight; exactly 0 on ignored rows
    ref_log_probs: torch.Tensor | None  #: fp32 [N] when given (always when ``kl_coef`` is not 0)
    tis_weight: torch.Tensor | None  #: fp32 [N] ``min(exp(old - rollout), tis_cap)``, no gradient
    clip_low: float
    clip_high: float
    dual_clip: float | None  #: the dual-clip bound ``c > 1`` for negative advantages, or None
    entropy_coef: float
    kl_coef: float
    kl_estimator: str  #: one of :data:`KL_ESTIMATORS`
    need_hidden_grad: bool  #: compute ``grad_hidden`` (hidden requires grad, grad enabled)
    need_weight_grad: bool  #: compute ``grad_weight``


@dataclass(frozen=True)
class PolicyLossResult:
    """What ``policy_loss`` returns: detached fp32 ``[N]`` statistics and the loss's gradients.

    ``log_probs`` and ``entropy`` are exactly 0 on ignored rows; ``grad_hidden`` (hidden's shape
    ``[N, H]`` and dtype) and ``grad_weight`` (weight's) are set exactly when the call needs them,
    with exactly zero rows of ``grad_hidden`` at ignored rows and nothing of those rows in
    ``grad_weight``. Either may be fp32 where the inputs are fp16 (its true values may lie
    below fp16's range until the upstream scale lifts them, ``fusedhead.fp16_range``; the core
    rounds it after that scale). The core forms the loss from the statistics and attaches the gradients.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor
    grad_hidden: torch.Tensor | None = None
    grad_weight: torch.Tensor | None = None


@runtime_checkable
class FusedHeadBackend(Protocol):
    """A named implementation of the fused LM-head computation (plugin API version 2)."""

    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]]  # extra fields forbidden
    plugin_api_version: ClassVar[int]

    def __init__(self, options: Any) -> None: ...

    def capabilities(self, device: torch.device) -> Capabilities:
        """Declare what this backend does on ``device``."""
        ...

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise ``BackendUnavailableError`` (with the reason and the fix) if it cannot run here."""
        ...

    def forward(self, call: HeadCall) -> HeadOutput:
        """The requested outputs of ``call``, fp32 ``[N]``, differentiable."""
        ...

    # Optional: ``kl(self, call: KLCall) -> KLOutput`` when ``capabilities().kl_directions`` is set,
    # and ``policy_loss(self, call: PolicyLossCall) -> PolicyLossResult`` when it declares
    # ``policy_loss``.


def call_backend(
    backend: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``backend.forward(HeadCall.make(...))`` as ``(log_probs, entropy)``: tests and tools."""
    out = backend.forward(HeadCall.make(hidden, weight, labels, **kwargs))
    return out.log_probs, out.entropy


#: Each method a backend class must define, with its parameters after ``self``.
METHOD_PARAMETERS: dict[str, tuple[str, ...]] = {
    "capabilities": ("device",),
    "check": ("device", "dtype"),
    "forward": ("call",),
}
#: The methods of optional capabilities, checked like those above where a class defines them.
OPTIONAL_METHOD_PARAMETERS: dict[str, tuple[str, ...]] = {
    "policy_loss": ("call",),
    "kl": ("call",),
}
