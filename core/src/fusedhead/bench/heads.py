"""What a benchmark case computes: the head call of ``--case`` (issue 18's outputs).

``logprobs`` (the default) is the label log-prob and entropy; the others time one more output of
a fusedhead backend, with an upstream gradient through it so that forward + backward is the
training step a distillation loss runs:

- ``topk<k>`` (e.g. ``topk32``): log-probs and the top-k ids and log-probs;
- ``gather<K>`` (e.g. ``gather32``): log-probs at K random ids per row (a teacher's top-k);
- ``lse``, ``sum_p2``, ``argmax``: log-probs with that per-token extra;
- ``kl`` / ``kl-reverse``: the per-token KL between the student head and a teacher head of the
  same shape, drawn independently (forward ``KL(p_t || p_s)`` / reverse), gradients to the
  student only;
- ``policy``: the RL policy loss's forward + backward (``fusedhead.bench.policy``): the backend's
  ``policy_loss``, ``unfused:NAME`` and the peers with entropy each through the same loss.

Each builder returns ``fn(h, w, y) -> (primary [N], secondary [N] | None)`` for the measurement
loop: wide outputs enter as their row mean, so one ``[N]`` upstream gradient reaches all of them.
A case's own inputs (the gather ids, the teacher) are made by the builder, before any measured
step, as the case's hidden states and weight are. Peers compute only ``logprobs`` and ``policy``.
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
#: Offsets of the seeds of a head case's own inputs from ``case.seed`` (the student's inputs use
#: ``case.seed`` itself, the policy terms ``+ 31``): one stream per tensor, so that no two draws
#: repeat each other (a teacher weight row equal to a teacher hidden row made the teacher one-hot).
SEED_TEACHER_WEIGHT, SEED_TEACHER_HIDDEN, SEED_GATHER_IDS = 18, 19, 20
#: The teacher's temperature in the ``kl`` cases.
TEACHER_TEMPERATURE = 1.0


def parse(name: str) -> tuple[str, int]:
    """``(kind, size)`` of a case name: ``topk32`` is ``("topk", 32)``; others have size 0."""
    m = _PATTERN.fullmatch(name)
    if m is None:
        from fusedhead.checks import did_you_mean

        kinds = ("logprobs", "lse", "sum_p2", "argmax", "kl", "kl-reverse", "policy")
        raise ValueError(
            f"--case {name!r} is not a head case{did_you_mean(name, kinds) or '.'} Expected logprobs, "
            "topk<k>, gather<K>, lse, sum_p2, argmax, kl, kl-reverse or policy (e.g. --case "
            "logprobs topk32 gather32 kl)"
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


def refusal(name: str, caps: Any, *, temperature: float | None = None) -> str | None:
    """Why a backend with capabilities ``caps`` cannot run the case, or None: every limit it
    declares for what the case asks (its outputs, ``max_top_k``, ``kl_directions``,
    ``policy_loss``, and with ``temperature`` given, ``min_temperature``), so that the bench
    records a skip with the reason rather than the call's ``CapabilityError``."""
    kind, size = parse(name)
    why = _case_refusal(kind, size, caps)
    if why is not None or temperature is None:
        return why
    # The KL's teacher runs at temperature 1 (``build``): the smaller of the two is checked.
    lowest = min(temperature, TEACHER_TEMPERATURE) if kind.startswith("kl") else temperature
    floor = float(caps.min_temperature)
    if lowest < floor:
        what = "temperature" if lowest == temperature else "teacher temperature"
        return (
            f"computes at temperatures >= {floor:g} (it declares min_temperature={floor:g}); "
            f"the case's {what} is {lowest:g}"
        )
    return None


def _case_refusal(kind: str, size: int, caps: Any) -> str | None:
    """The declared limits ``refusal`` checks that depend on the case alone (not its temperature)."""
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
    if kind == "topk" and size > caps.max_top_k:
        return f"takes top_k up to {caps.max_top_k} (it declares max_top_k), not {size}"
    return None


def _generator(case: Any, offset: int) -> torch.Generator:
    return torch.Generator(device=torch.device(case.device)).manual_seed(case.seed + offset)


def teacher(case: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``kl`` cases' teacher, a head of the student's shape drawn independently of it and of
    itself: hidden states ``[N, H] ~ N(0, 1)`` and weight ``[V, H] ~ N(0, (2 s / sqrt(H))^2)``
    (more peaked than the student's), in the case's dtype."""
    device = torch.device(case.device)
    gen = _generator(case, SEED_TEACHER_HIDDEN)
    hidden = torch.randn(case.n, case.hidden, device=device, generator=gen).to(case.torch_dtype)
    weight = torch.empty(case.vocab, case.hidden, device=device)
    weight.normal_(
        0.0, 2.0 * case.scale / case.hidden**0.5, generator=_generator(case, SEED_TEACHER_WEIGHT)
    )
    return hidden, weight.to(case.torch_dtype)


def gather_ids(case: Any, size: int) -> torch.Tensor:
    """The ``gather<K>`` case's ``[N, K]`` int64 ids, uniform over the vocabulary."""
    gen = _generator(case, SEED_GATHER_IDS)
    return torch.randint(
        0, case.vocab, (case.n, size), device=torch.device(case.device), generator=gen
    )


def build(name: str, case: Any, head: Any, temperature: float, ignore_index: int) -> Fn:
    """The timed call of case ``name`` through the resolved ``FusedHead``."""
    kind, size = parse(name)
    if kind == "policy":
        from fusedhead.bench import policy

        return policy.fused(case, head)
    # The case's own inputs, made now for all its rows: before any measured step on any device
    # (the memory child warms up on its first rows, which take the first rows of these).
    rows: torch.Tensor | None = None
    if kind == "gather":
        rows = gather_ids(case, size)
    elif kind in ("kl", "kl-reverse"):
        rows, t_weight = teacher(case)

    def per_row(n: int) -> torch.Tensor:
        assert rows is not None and n <= rows.shape[0], (n, case.n)
        return rows[:n]

    if kind in ("kl", "kl-reverse"):
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
                teacher_temperature=TEACHER_TEMPERATURE,
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
