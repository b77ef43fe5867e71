"""What a benchmark case computes: the head call of ``--case`` (issue 18's outputs).

``logprobs`` (the default) is the label log-prob and entropy; the others time one more output of
a fusedhead backend, with an upstream gradient through it so that forward + backward is the
training step a distillation loss runs:

- ``topk<k>`` (e.g. ``topk32``): log-probs and the top-k ids and log-probs;
- ``gather<K>`` (e.g. ``gather32``): log-probs at K random ids per row (a teacher's top-k);
- ``lse``, ``sum_p2``, ``argmax``: log-probs with that per-token extra;
- ``kl`` / ``kl-reverse``: the per-token KL between the student head and a teacher head of the
  same shape (forward ``KL(p_t || p_s)`` / reverse), gradients to the student only;
- ``policy``: the RL policy loss's forward + backward (``fusedhead.bench.policy``): the backend's
  ``policy_loss``, ``unfused:NAME`` and the peers with entropy each through the same loss.

Each builder returns ``fn(h, w, y) -> (primary [N], secondary [N] | None)`` for the measurement
loop: wide outputs enter as their row mean, so one ``[N]`` upstream gradient reaches all of them.
Peers compute only ``logprobs`` and ``policy``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]

DEFAULT = "logprobs"
#: ASCII digits only (``\d`` takes any script's: ``topk٣`` would be ``topk3``), the whole name.
_PATTERN = re.compile(
    r"(logprobs|lse|sum_p2|argmax|kl|kl-reverse|policy|topk([0-9]+)|gather([0-9]+))"
)
#: The output each case asks of a backend (for the capability check before measuring).
_OUTPUT = {"topk": "topk", "gather": "gather", "lse": "lse", "sum_p2": "sum_p2", "argmax": "argmax"}


def parse(name: str) -> tuple[str, int]:
    """``(kind, size)`` of a case name: ``topk32`` is ``("topk", 32)``; others have size 0."""
    m = _PATTERN.fullmatch(name)
    if m is None:
        raise ValueError(
            f"--case {name!r} is not a head case; expected logprobs, topk<k>, gather<K>, lse, "
            "sum_p2, argmax, kl, kl-reverse or policy (e.g. --case logprobs topk32 gather32 kl)"
        )
    size = int(m.group(2) or m.group(3) or 0)
    kind = "topk" if m.group(2) else "gather" if m.group(3) else name
    if kind in ("topk", "gather") and size < 1:
        raise ValueError(f"--case {name!r}: the size must be at least 1")
    return kind, size


def canonical(name: str) -> str:
    """The case's name as the bench records it: ``topk05`` is ``topk5``, the same case."""
    kind, size = parse(name)
    return f"{kind}{size}" if kind in ("topk", "gather") else kind


def refusal(name: str, caps: Any) -> str | None:
    """Why a backend with capabilities ``caps`` cannot run the case, or None."""
    kind, _ = parse(name)
    if kind == DEFAULT:
        return None
    if kind == "policy":
        if not caps.policy_loss:
            return (
                "does not declare policy_loss (the loss's gradients computed in its forward); "
                "--impl unfused:NAME runs its log-probs and entropy, then the loss in torch"
            )
        return None
    if kind.startswith("kl"):
        direction = "reverse" if kind == "kl-reverse" else "forward"
        if direction not in caps.kl_directions:
            return f"does not declare the {direction} KL of two heads (kl_directions)"
        return None
    output = _OUTPUT[kind]
    if output not in caps.outputs:
        return f"does not declare the output {output!r} (it declares {list(caps.outputs)})"
    return None


def _generator(case: Any) -> torch.Generator:
    return torch.Generator(device=torch.device(case.device)).manual_seed(case.seed + 18)


def build(name: str, case: Any, head: Any, temperature: float, ignore_index: int) -> Fn:
    """The timed call of case ``name`` through the resolved ``FusedHead``."""
    kind, size = parse(name)
    if kind == "policy":
        from fusedhead.bench import policy

        return policy.fused(case, head)
    device = torch.device(case.device)
    # Per-row inputs for the rows a call gets (the memory child warms up on a few rows first).
    made: dict[int, torch.Tensor] = {}

    def per_row(n: int) -> torch.Tensor:
        if n not in made:
            gen = _generator(case)
            if kind == "gather":
                made[n] = torch.randint(0, case.vocab, (n, size), device=device, generator=gen)
            else:  # the teacher's hidden states
                made[n] = torch.randn(n, case.hidden, device=device, generator=gen).to(
                    case.torch_dtype
                )
        return made[n]

    if kind in ("kl", "kl-reverse"):
        t_weight = torch.empty(case.vocab, case.hidden, device=device)
        t_weight.normal_(0.0, 2.0 * case.scale / case.hidden**0.5, generator=_generator(case))
        t_weight = t_weight.to(case.torch_dtype)
        direction = "reverse" if kind == "kl-reverse" else "forward"

        def kl_fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, None]:
            kl = head.kl(
                h,
                w,
                per_row(h.shape[0]),
                t_weight,
                y,
                direction=direction,
                temperature=temperature,
                teacher_temperature=1.0,
                ignore_index=ignore_index,
            )
            return kl, None

        return kl_fn
    kwargs: dict[str, Any] = {"return_entropy": False}
    if kind == "topk":
        kwargs["top_k"] = size
    elif kind in ("lse", "sum_p2", "argmax"):
        kwargs[f"return_{kind}"] = True

    def fn(
        h: torch.Tensor, w: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        call = dict(kwargs)
        if kind == "gather":
            call["gather_ids"] = per_row(h.shape[0])
        out = head(h, w, y, temperature=temperature, ignore_index=ignore_index, **call)
        extra = {
            "topk": out.topk_log_probs,
            "gather": out.gathered,
            "lse": out.lse,
            "sum_p2": out.sum_p2,
        }.get(kind)
        if extra is None:
            return out.log_probs, None
        return out.log_probs, extra.mean(-1) if extra.dim() == 2 else extra

    return fn
