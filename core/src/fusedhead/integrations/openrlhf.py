"""OpenRLHF: an opt-in patch of ``Actor.forward`` that scores with a fusedhead backend by name.

OpenRLHF's ``openrlhf.models.actor.Actor.forward`` always runs the whole causal LM, casts its
``[B, T, V]`` logits to float32 and takes log-softmax and entropy from them; it has no hook for
another head. :func:`patch_actor` is the one public function that changes that, on one ``Actor``
instance only (never the class). Its forward still calls the model itself (through DeepSpeed's
engine, PEFT, the MoE router loss), with the LM head's forward stood in for during that one
call: there the head's weight is read, after ZeRO-3 / FSDP2 hooks have gathered it, and the last
hidden states go with labels rolled exactly as OpenRLHF rolls them to ``lm_head_logprobs``; the
head returns empty ``[..., 0]`` logits. The packed (``packing_samples``) layout is built and
undone by OpenRLHF's own ``unpad_and_slice_tensor`` / ``gather_and_pad_tensor``.

Which rows are scored: by default only positions whose next token is real
(``attention_mask[:, t + 1] == 1``), the only ones OpenRLHF's losses read (the action window, SFT
and DPO masks); other positions are 0. ``score_all_positions=True`` scores every position as
OpenRLHF does (padding included). Calls that ask for logits (no ``action_mask``, no
``return_logprobs``) and vision-language inputs are not the head's job: the former go to the
original forward, the latter are refused. Tested with OpenRLHF 0.11.2.

The upstream change that would remove this patch: a ``logprobs_fn`` hook on ``Actor`` (see
docs/integrations/openrlhf.md).
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
from torch import nn

from fusedhead.api import FusedHead, FusedHeadOutput
from fusedhead.checks import positive_float
from fusedhead.integrations.backend_spec import (
    HeadLike,
    check_head_runs_on,
    refuse_decided_settings,
    resolve_lm_head,
)
from fusedhead.integrations.lm_head import lm_head_logprobs
from fusedhead.integrations.logit_transforms import model_logit_transform

__all__ = ["TESTED_OPENRLHF", "is_patched", "patch_actor", "unpatch_actor"]

#: OpenRLHF versions this module was tested against.
TESTED_OPENRLHF = ">=0.11.2,<0.12"
_ATTR = "_fusedhead_head"
#: Where a patched actor keeps the instance ``forward`` it had before (None: the class's).
_BEFORE = "_fusedhead_forward_before"


def _ring_utils() -> types.ModuleType:
    try:
        from openrlhf.models import ring_attn_utils
    except ImportError as exc:
        raise ImportError(
            f"fusedhead.integrations.openrlhf needs OpenRLHF ({TESTED_OPENRLHF} tested) and the "
            f"modules its models import: {exc}"
        ) from exc
    return ring_attn_utils  # type: ignore[no-any-return]


#: How a refusal names the temperature the actor divides its logits by.
TEMPERATURE_SETTING = "the actor's temperature (OpenRLHF's --rollout.temperature)"


#: The head settings each patched call decides, and who decides them.
DECIDED_BY = {
    "temperature": TEMPERATURE_SETTING,
    "softcap": "the model's config (final_logit_softcapping)",
    "ignore_index": "patch_actor (its unscored positions)",
    "return_entropy": "each call's return_entropy (OpenRLHF's)",
}


def _parts(actor: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the causal LM, its LM head) of ``actor.model``: DeepSpeed and PEFT wrappers unwrapped."""
    model = getattr(actor, "model", None)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"actor must be an openrlhf Actor with a .model, got {type(actor).__name__}"
        )
    lm: nn.Module = model
    # After strategy.prepare, actor.model is a DeepSpeedEngine around the model (.module).
    while type(lm).__name__ in ("DeepSpeedEngine", "DistributedDataParallel") and isinstance(
        getattr(lm, "module", None), nn.Module
    ):
        lm = lm.module  # type: ignore[assignment]
    get_base = getattr(lm, "get_base_model", None)  # PEFT
    if callable(get_base):
        lm = get_base()
    get_head = getattr(lm, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        raise TypeError(
            f"actor.model ({type(lm).__name__}) has no LM head (get_output_embeddings() gave "
            "None): actor must be an openrlhf Actor, whose .model is a causal LM"
        )
    if not isinstance(head, nn.Linear):
        kind = f"{type(head).__module__}.{type(head).__qualname__}"
        raise TypeError(
            f"{type(lm).__name__}'s LM head is a {kind}, not a torch.nn.Linear (a LoRA adapter on "
            "the LM head, or DeepSpeed AutoTP's sharded layer, is not supported): fusedhead "
            "scores head.weight [+ head.bias] of a plain Linear"
        )
    return lm, head


def is_patched(actor: nn.Module) -> bool:
    """Whether :func:`patch_actor` patched this actor."""
    if not isinstance(actor, nn.Module):
        raise TypeError(f"actor must be an openrlhf Actor, got {type(actor).__name__}")
    return isinstance(actor.__dict__.get(_ATTR), FusedHead)


def unpatch_actor(actor: nn.Module) -> None:
    """Give the actor back the forward it had before :func:`patch_actor` (its own instance
    attribute, where it had one, else its class's)."""
    if is_patched(actor):
        before = actor.__dict__.pop(_BEFORE)
        if before is None:
            del actor.__dict__["forward"]
        else:
            actor.__dict__["forward"] = before
        del actor.__dict__[_ATTR]


def _empty_logits(hidden: torch.Tensor, out: FusedHeadOutput) -> torch.Tensor:
    """The stand-in head's ``[..., 0]`` logits, made from the fused outputs where they carry a
    gradient: what the model returns then leads back to them, so the hooks on the head's output
    run in the backward before the fused head's (ZeRO-3's, which gathers the weight again that
    its forward hook released; without them the backward read a 0-element weight)."""
    parts = [t for t in (out.log_probs, out.entropy) if t is not None and t.requires_grad]
    if not parts:
        return hidden.new_zeros((*hidden.shape[:-1], 0))
    empty = sum(t.unsqueeze(-1)[..., :0] for t in parts)
    return cast(torch.Tensor, empty).to(hidden.dtype)


def _through_head_output(out: FusedHeadOutput, output: Any) -> tuple[Any, Any]:
    """The fused log-probs and entropy, each plus the sum of the model's empty logits (zero):
    their gradient then passes through the head's output and its hooks (``_empty_logits``)."""
    logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor) or not logits.requires_grad or logits.shape[-1]:
        return out.log_probs, out.entropy
    zero = logits.sum(-1).to(out.log_probs.dtype).reshape(out.log_probs.shape)
    entropy = None if out.entropy is None else out.entropy + zero
    return out.log_probs + zero, entropy


def patch_actor(
    actor: nn.Module, backend: HeadLike = None, *, score_all_positions: bool = False
) -> FusedHead:
    """Make ``actor.forward`` score log-probs and entropy with the fusedhead backend named.

    ``backend``: a name (``"triton"``), a trainer spelling (``"fusedhead:triton"``), a config
    mapping, a ``FusedHeadConfig`` or a ``FusedHead``; None is the default backend (``torch``).
    Returns the resolved head. Patching twice replaces the head. See the module docstring for
    which positions are scored and which calls keep the original forward.
    """
    if not isinstance(actor, nn.Module):
        raise TypeError(f"actor must be an openrlhf Actor, got {type(actor).__name__}")
    if not isinstance(score_all_positions, bool):
        raise TypeError(
            f"score_all_positions must be a bool, got {type(score_all_positions).__name__}"
        )
    if getattr(actor, "is_vlm", False):
        raise NotImplementedError(
            "patch_actor does not handle vision-language actors (is_vlm): their forward feeds "
            "multimodal inputs and M-RoPE positions fusedhead does not reproduce"
        )
    ring = _ring_utils()
    lm, lm_head = _parts(actor)  # fail now, not on the first step
    model_logit_transform(getattr(lm, "config", None), head_input=True)  # refused now
    # read again at every forward (a changed temperature applies); a bad one named now
    positive_float(TEMPERATURE_SETTING, getattr(actor, "temperature", 1.0))
    # an unknown or malformed name is reported as this argument's value, as it was written
    setting = "patch_actor(backend=...)"
    head = resolve_lm_head(backend, setting=setting)
    refuse_decided_settings(head, setting, DECIDED_BY)
    weight = cast(torch.Tensor, lm_head.weight)  # _parts returned an nn.Linear
    # The backend must run where the head's weight is, named now; an Actor patched before
    # strategy.prepare still has its weight on the CPU where a GPU is there to take it: its
    # first forward checks it instead (a GPU-only backend was refused for the CPU it leaves).
    moving = weight.device.type == "cpu" and torch.cuda.is_available()
    if weight.device.type != "meta" and not moving:
        check_head_runs_on(
            head,
            weight.device,
            weight.dtype,
            setting=setting,
            value=backend if isinstance(backend, str) else None,
            options_via="a mapping: patch_actor(actor, {'backend': NAME, 'options': {...}})",
        )
    unpatch_actor(actor)
    before = actor.__dict__.get("forward")  # a wrapper set on this instance, given back after
    original = actor.forward

    def forward(
        self: nn.Module,
        sequences: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_output: bool = False,
        allgather_logits: bool = False,
        return_logprobs: bool = False,
        ring_attn_group: Any = None,
        packed_seq_lens: list[int] | None = None,
        return_entropy: bool = False,
        **mm_inputs: Any,
    ) -> Any:
        if action_mask is None and not return_logprobs:  # the caller wants the logits
            return original(
                sequences,
                action_mask,
                attention_mask=attention_mask,
                return_output=return_output,
                allgather_logits=allgather_logits,
                return_logprobs=return_logprobs,
                ring_attn_group=ring_attn_group,
                packed_seq_lens=packed_seq_lens,
                return_entropy=return_entropy,
                **mm_inputs,
            )
        if mm_inputs:
            raise ValueError(
                f"patch_actor's forward takes no multimodal inputs, got {sorted(mm_inputs)}"
            )
        if return_entropy and not return_output:
            raise ValueError("return_entropy=True needs return_output=True (as in OpenRLHF)")
        if attention_mask is None:
            raise ValueError("attention_mask is required (OpenRLHF's Actor.forward needs it too)")
        lm, lm_head = _parts(self)
        batch, seqlen = sequences.shape
        # Positions whose next token is real: the only ones OpenRLHF's losses read.
        needed = torch.zeros_like(attention_mask, dtype=torch.bool)
        needed[:, :-1] = attention_mask[:, 1:].bool()
        if getattr(self, "packing_samples", False):
            ids, position_ids, labels, pad_len, indices = ring.unpad_and_slice_tensor(
                sequences, attention_mask, ring_attn_group
            )
            if not score_all_positions and ring_attn_group is None:
                keep = needed.reshape(-1)[indices].unsqueeze(0)
                labels = labels.masked_fill(~keep, -100)
            model_mask = None
        else:
            ids = sequences
            labels = torch.roll(sequences, shifts=-1, dims=1)
            if not score_all_positions:
                labels = labels.masked_fill(~needed, -100)
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            model_mask = attention_mask
        scale, softcap = model_logit_transform(lm.config, head_input=True)  # what lm_head gets
        scored: list[FusedHeadOutput] = []

        def score(hidden: torch.Tensor) -> torch.Tensor:
            # Stands in for lm_head's forward during the model's own call: the weight is read
            # here, where ZeRO-3 / FSDP2 have gathered it. Returns empty logits [..., 0].
            out = lm_head_logprobs(
                lm_head,
                hidden,
                labels,
                head=head,
                temperature=positive_float(TEMPERATURE_SETTING, getattr(self, "temperature", 1.0)),
                return_entropy=return_entropy,
                softcap=softcap,
                logit_scale=scale,
                in_call=False,
            )
            scored.append(out)
            return _empty_logits(hidden, out)

        own = lm_head.__dict__  # an instance attribute shadows the class's forward, one call
        had_own, previous = "forward" in own, own.get("forward")
        own["forward"] = score
        try:
            output = self.model(  # type: ignore[operator]
                ids, attention_mask=model_mask, position_ids=position_ids
            )
        finally:
            if had_own:
                own["forward"] = previous
            else:
                del own["forward"]
        if len(scored) != 1:
            raise RuntimeError(
                f"{type(lm).__name__}'s forward called its lm_head {len(scored)} times, expected once"
            )
        log_probs, entropy = _through_head_output(scored[0], output)
        if getattr(self, "packing_samples", False):
            log_probs = ring.gather_and_pad_tensor(
                log_probs, ring_attn_group, pad_len, indices, batch, seqlen
            )
            if entropy is not None:
                entropy = ring.gather_and_pad_tensor(
                    entropy, ring_attn_group, pad_len, indices, batch, seqlen
                )
        log_probs = log_probs[:, :-1]
        if entropy is not None:
            output.entropy = entropy[:, :-1]
        if action_mask is None:
            return (log_probs, output) if return_output else log_probs
        action_log_probs = log_probs[:, -action_mask.shape[1] :] * action_mask.float()
        return (action_log_probs, output) if return_output else action_log_probs

    actor.forward = types.MethodType(forward, actor)  # type: ignore[method-assign]
    actor.__dict__[_BEFORE] = before
    actor.__dict__[_ATTR] = head
    return head
