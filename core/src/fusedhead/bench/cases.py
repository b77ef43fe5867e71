"""The benchmark grid and its inputs, drawn from a fixed generator as docs/design.md specifies.

``h ~ N(0, 1)``, ``W ~ N(0, (scale / sqrt(H))^2)`` (scale 1: flat distributions, 4: peaked), labels
uniform over the vocabulary with a tenth set to ``ignore_index``; upstream gradients of log-probs and
entropy ~ N(0, 1) so that both terms of the backward are exercised.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

IGNORE_INDEX = -100
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class Case:
    """One problem shape on one device: what every implementation is measured on."""

    n: int
    hidden: int
    vocab: int
    dtype: str = "fp32"
    temperature: float = 0.7
    scale: float = 1.0
    seed: int = 0
    device: str = "cpu"
    #: What each call computes (``fusedhead.bench.heads``): ``logprobs`` or an issue-18 output.
    head: str = "logprobs"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def label(self) -> str:
        """A short human-readable name of the case."""
        label = f"N={self.n} H={self.hidden} V={self.vocab} {self.dtype} T={self.temperature:g} s={self.scale:g}"
        return label if self.head == "logprobs" else f"{label} {self.head}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Case:
        return cls(**data)

    def input_bytes(self) -> int:
        """Bytes of hidden and weight in the case's dtype."""
        return (self.n + self.vocab) * self.hidden * ELEMENT_BYTES[self.dtype]


def device_bytes(device: torch.device) -> int | None:
    """The memory a case's tensors can live in: a GPU's own, or the machine's (None: unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf names here (not POSIX)
        return None


#: What each head case adds to the inputs (``head_bytes``), named in ``refuse_unfit``'s message.
_HEAD_PARTS = {
    "topk": "the [N, k] top-k ids, log-probs and their gradient",
    "gather": "the [N, K] gathered ids, log-probs and their gradient",
    "kl": "the teacher's hidden states and weight",
    "kl-reverse": "the teacher's hidden states and weight",
}


def head_bytes(case: Case) -> int:
    """Bytes a head case adds to the inputs: ``topk<k>`` / ``gather<K>`` their ``[N, K]`` ids
    (int64), outputs and gradients (fp32); ``kl`` / ``kl-reverse`` the teacher's hidden states
    and weight; the others nothing the inputs' size does not bound."""
    from fusedhead.bench import heads

    kind, size = heads.parse(case.head)
    if kind in ("topk", "gather"):
        return case.n * size * (8 + 4 + 4)
    if kind in ("kl", "kl-reverse"):
        return case.input_bytes()
    return 0


def refuse_unfit(cases: list[Case], device: torch.device) -> None:
    """A case whose hidden states, weight and one ``[N, V]`` logits GEMM (the GEMM unit, and the
    full-logits reference's block), with what its head case adds (``head_bytes``), exceed the
    device's memory is refused by its sizes, before any input is made: past it, a run fails after
    minutes of building, or in an overflow inside torch."""
    from fusedhead.bench import heads

    total = device_bytes(device)
    for case in cases:
        need = case.input_bytes() + case.n * case.vocab * ELEMENT_BYTES[case.dtype]
        extra = head_bytes(case)
        if total is not None and need + extra > total:
            what, where = "the hidden states, the weight and one [N, V] GEMM of logits", ""
            if extra:
                part = _HEAD_PARTS[heads.parse(case.head)[0]]
                what = f"the hidden states, the weight, one [N, V] GEMM of logits and {part}"
                where = f" --case {case.head}"
            raise ValueError(
                f"--n {case.n} --hidden {case.hidden} --vocab {case.vocab}{where} ({case.dtype}): "
                f"{what} take {(need + extra) / 2**30:.3g} GiB, more than the "
                f"{total / 2**30:.3g} GiB of {device}; use smaller sizes"
            )


def logit_bound(case: Case) -> float:
    """About the largest ``|logit|`` the case's inputs give, with a margin: the logits ``h . w``
    are formed in the case's dtype, and over the temperature in fp32 (the statistics).

    Given the row ``h_i``, each logit is ``N(0, (s ||h_i|| / sqrt(H))^2)``; the largest row norm is
    about ``sqrt(H) + sqrt(2 ln N)`` and the largest of ``N V`` such logits about
    ``sqrt(2 ln(N V))`` standard deviations, each taken at a one-in-a-million tail.
    """
    rows = math.sqrt(2.0 * math.log(1e6 * case.n))
    tail = math.sqrt(2.0 * math.log(2e6 * case.n * case.vocab))
    return case.scale * (1.0 + rows / math.sqrt(case.hidden)) * tail


def _round_down(value: float) -> str:
    """``value`` to 3 significant digits, rounded down: a limit that the text given back keeps."""
    step = 10.0 ** (math.floor(math.log10(value)) - 2)
    return f"{math.floor(value / step) * step:.3g}"


def refuse_overflow(cases: list[Case]) -> None:
    """A case whose logits would overflow (``--scale`` large for fp16's 65504, or the logits over
    a temperature near 0 past fp32's range) is refused by name before any work: past it, inputs
    or logits are inf and every error NaN."""
    fp32_top = float(torch.finfo(torch.float32).max)
    for case in cases:
        raw = logit_bound(case)
        over = raw / min(1.0, case.temperature)
        top = float(torch.finfo(case.torch_dtype).max)
        if raw <= top and over <= fp32_top:
            continue
        if raw > top:
            what = f"the logits reach about {raw:.3g}, past {case.dtype}'s largest value {top:.5g}"
        else:
            what = (
                f"the logits over the temperature reach about {over:.3g}, past fp32's largest "
                f"value {fp32_top:.5g} (the statistics are fp32)"
            )
        fits = case.scale * min(top / raw, fp32_top / over)
        if raw > top:
            other = ", or --dtype bf16 or fp32" if case.dtype == "fp16" else ""
        else:
            other = ", or a larger --temperature"
        raise ValueError(
            f"--scale {case.scale:g} with --dtype {case.dtype} and --temperature "
            f"{case.temperature:g} (--n {case.n} --hidden {case.hidden} --vocab {case.vocab}): "
            f"{what} (inputs or logits would be inf, every error NaN); expected --scale <= "
            f"{_round_down(fits)} at these sizes{other}"
        )


@dataclass
class Inputs:
    """Tensors of one case; ``hidden`` and ``weight`` are leaves that do not require grad."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    grad_log_probs: torch.Tensor
    grad_entropy: torch.Tensor


def grid(
    ns: list[int],
    hiddens: list[int],
    vocabs: list[int],
    dtypes: list[str],
    *,
    temperature: float,
    scales: list[float],
    seed: int,
    device: str,
    heads: list[str] | None = None,
) -> list[Case]:
    """Every combination, ordered so the cheap cases of a shape family come first."""
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"--dtype {d!r} is not one of {sorted(DTYPES)}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"--temperature must be a finite float > 0, got {temperature!r}")
    for name, values in (("--n", ns), ("--hidden", hiddens), ("--vocab", vocabs)):
        if not values or any(v < 1 for v in values):
            raise ValueError(f"{name} needs positive integers, got {values}")
    from fusedhead.bench import heads as head_cases

    for name in heads or ():
        kind, size = head_cases.parse(name)  # a bad name is a ValueError naming --case
        if kind in ("topk", "gather") and size > min(vocabs):  # refused now, not as each case's
            k = "k" if kind == "topk" else "K"
            what = "top-k ids" if kind == "topk" else "ids gathered per row"
            raise ValueError(
                f"--case {name}: {k} = {size} is larger than --vocab {min(vocabs)}; expected "
                f"{k} <= {min(vocabs)} ({what}: at most the vocabulary), or a larger vocabulary"
            )
    heads = [head_cases.canonical(name) for name in heads or ["logprobs"]]  # topk05 is topk5
    cases = [
        Case(n, h, v, d, temperature, s, seed, device, head)
        for head, d, h, v, s, n in itertools.product(
            heads, dtypes, hiddens, vocabs, scales, sorted(ns)
        )
    ]
    refuse_overflow(cases)
    return cases


def make_inputs(case: Case) -> Inputs:
    """The case's tensors, drawn on its device from a generator seeded by ``case.seed``."""
    device = torch.device(case.device)
    gen = torch.Generator(device=device).manual_seed(case.seed)
    kw: dict[str, Any] = {"device": device, "generator": gen}
    dtype = case.torch_dtype
    hidden = torch.randn(case.n, case.hidden, dtype=torch.float32, **kw).to(dtype)
    weight = torch.empty(case.vocab, case.hidden, dtype=torch.float32, device=device)
    weight.normal_(0.0, case.scale / math.sqrt(case.hidden), generator=gen)
    weight = weight.to(dtype)
    labels = torch.randint(0, case.vocab, (case.n,), dtype=torch.int64, **kw)
    ignored = torch.randperm(case.n, **kw)[: case.n // 10]
    labels[ignored] = IGNORE_INDEX
    grad_lp = torch.randn(case.n, dtype=torch.float32, **kw)
    grad_ent = torch.randn(case.n, dtype=torch.float32, **kw)
    return Inputs(hidden, weight, labels, grad_lp, grad_ent)
