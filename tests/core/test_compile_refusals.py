"""A bad scalar under ``torch.compile(fullgraph=True)`` once Dynamo has made it symbolic: the
refusal eager mode gives, by name, not Dynamo's own error about the check that gives it.

Dynamo specializes a Python float or int on the first call and makes it symbolic (a SymFloat /
SymInt) once its value changes, as a temperature schedule's does. A check then compares the
symbol (a guard), and a bad value retraces the call into the refusal, whose message formatted the
symbol: Dynamo cannot (``BUILD_STRING type error``), nor trace ``super().__init__`` of a
``CapabilityError`` (a backend's ``min_temperature``), nor ``math.isfinite`` of a symbol.

Under ``fullgraph=True`` torch 2.13 turns any exception raised while it traces into its own
``Unsupported`` ("Observed exception"), a constant argument's too (``test_compile_calls``), with
the exception's class and arguments in its message: ``refusal`` reads them there (or from the
exception itself, should a later torch raise it as is) and each test compares them with eager's.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from fusedhead import FusedHead, fused_head, fused_kl, fused_policy_loss
from fusedhead.errors import CapabilityError
from fusedhead.protocol import HeadCall, HeadOutput
from fusedhead.reference import reference_fused_head

#: Where Dynamo's fullgraph error names the exception the traced code raised.
_RAISED = re.compile(r"raised exception (\w+)\((.*)\)\n")
#: torch's own backend computes from 2**-100 (its min_temperature).
TORCH_FLOOR = 2.0**-100


def refusal(exc: BaseException) -> tuple[str, str]:
    """The class name and the first argument (the message; a backend error's reason) of the
    refusal ``exc`` is or, as Dynamo's fullgraph error, carries."""
    if isinstance(exc, torch._dynamo.exc.Unsupported):
        found = _RAISED.search(str(exc))
        assert found, f"Dynamo's error names no exception the call raised:\n{exc}"
        args = ast.literal_eval(f"({found.group(2)},)")
        return found.group(1), str(args[0])
    return type(exc).__name__, str(exc.args[0])


def eager_refusal(step: Callable[[Any], object], bad: object) -> tuple[str, str]:
    with pytest.raises(Exception) as info:
        step(bad)
    return refusal(info.value)


@pytest.fixture
def compile_symbolic() -> Iterator[Callable[..., Callable[[Any], object]]]:
    """``compile_symbolic(step, *goods)``: ``step`` compiled whole (backend eager) and called
    with the good values; the second compiles again and a third nothing new (the scalar is
    symbolic from the second on)."""
    torch._dynamo.reset()

    def make(step: Callable[[Any], object], *goods: object) -> Callable[[Any], object]:
        counter = CompileCounterWithBackend("eager")
        compiled = torch.compile(step, backend=counter, fullgraph=True)
        for good in goods:
            compiled(good)
        assert counter.frame_count == 2, "the scalar was not made symbolic"
        return compiled

    yield make
    torch._dynamo.reset()


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(6, 8, generator=g), torch.randn(12, 8, generator=g) / 3
    return hidden, weight, torch.randint(0, 12, (6,), generator=g)


def assert_same_refusal(
    compiled: Callable[[Any], object],
    step: Callable[[Any], object],
    bad: object,
    kind: type[Exception],
    *names: str,
) -> None:
    """The compiled call refuses ``bad`` as eager mode does (the class and the message whole),
    and the message holds ``names`` (the argument, the value, what was expected)."""
    want = eager_refusal(step, bad)
    assert want[0] == kind.__name__, want
    with pytest.raises(Exception) as info:
        compiled(bad)
    got = refusal(info.value)
    assert got == want, f"compiled: {got}\neager:    {want}"
    for name in names:
        assert name in got[1], (name, got)


# --- the core's range of a float: temperature, softcap, the KL's teacher ones --------------------


@pytest.mark.parametrize("bad", [0.0, -1.0, 1e-39, 1e300])
def test_temperature(compile_symbolic: Any, bad: float) -> None:
    h, w, y = inputs()

    def step(t: Any) -> torch.Tensor:
        return fused_head(h, w, y, temperature=t).log_probs

    compiled = compile_symbolic(step, 0.7, 0.5, 0.3)
    assert_same_refusal(
        compiled, step, bad, ValueError, "temperature must be a finite float > 0", f"got {bad}"
    )


def test_an_int_temperature(compile_symbolic: Any) -> None:
    """An int argument changed between calls is a SymInt."""
    h, w, y = inputs()

    def step(t: Any) -> torch.Tensor:
        return fused_head(h, w, y, temperature=t).log_probs

    compiled = compile_symbolic(step, 2, 3, 4)
    for bad in (0, -1):
        assert_same_refusal(
            compiled, step, bad, ValueError, "temperature must be a finite float > 0", f"got {bad}"
        )


@pytest.mark.parametrize("bad", [-2.0, 1e-40])
def test_softcap(compile_symbolic: Any, bad: float) -> None:
    h, w, y = inputs()
    head = FusedHead(backend="torch")

    def step(cap: Any) -> torch.Tensor:
        return head(h, w, y, softcap=cap).log_probs

    compiled = compile_symbolic(step, 30.0, 20.0, 10.0)
    assert_same_refusal(
        compiled, step, bad, ValueError, "softcap must be a finite float > 0", f"got {bad}"
    )


@pytest.mark.parametrize("arg", ["teacher_temperature", "teacher_softcap"])
def test_the_kl_teachers_scalars(compile_symbolic: Any, arg: str) -> None:
    h, w, y = inputs()

    def step(v: Any) -> torch.Tensor:
        return fused_kl(h, w, h, w, y, **{arg: v})

    compiled = compile_symbolic(step, 0.7, 0.5, 0.3)
    assert_same_refusal(
        compiled, step, 1e-39, ValueError, f"{arg} must be a finite float > 0", "got 1e-39"
    )


# --- a backend's min_temperature: a CapabilityError --------------------------------------------


@pytest.mark.parametrize("entry", ["fused_head", "fused_kl"])
def test_below_the_torch_backends_min_temperature(compile_symbolic: Any, entry: str) -> None:
    h, w, y = inputs()
    bad = TORCH_FLOOR / 8  # in the core's range, under the backend's floor

    def step(t: Any) -> torch.Tensor:
        if entry == "fused_head":
            return fused_head(h, w, y, temperature=t).log_probs
        return fused_kl(h, w, h, w, y, temperature=t)

    compiled = compile_symbolic(step, 0.7, 0.5, 0.3)
    assert_same_refusal(
        compiled, step, bad, CapabilityError, "min_temperature=7.88861e-31", f"temperature={bad!r}"
    )


def _forward(self: Any, call: HeadCall) -> HeadOutput:
    """The reference backend's forward without its record of calls (a list that kept the
    temperature would make Dynamo specialize it)."""
    lp, ent = reference_fused_head(
        call.hidden,
        call.weight,
        call.labels,
        temperature=call.temperature,
        ignore_index=call.ignore_index,
        return_entropy=call.return_entropy,
        compute_dtype=torch.float32,
    )
    return HeadOutput(lp, ent)


def test_a_symbolic_float_is_no_per_token_tensor(compile_symbolic: Any, variant: Any) -> None:
    """A backend without per-token temperatures takes a float that changed between calls: the
    gate told a tensor by the class, and a symbolic float's is SymFloat (a CapabilityError
    "does not support a per-token temperature tensor" for a good value)."""
    variant("floats-only", forward=_forward)
    h, w, y = inputs()

    def step(t: Any) -> torch.Tensor:
        return fused_head(h, w, y, backend="floats-only", temperature=t).log_probs

    compiled = compile_symbolic(step, 0.7, 0.5, 0.3)
    torch.testing.assert_close(compiled(0.4), step(0.4))


def test_below_a_plugins_min_temperature(compile_symbolic: Any, variant: Any) -> None:
    """An in-process backend's own floor, as triton declares one."""
    variant("floor-test", forward=_forward, caps={"min_temperature": 0.25})
    h, w, y = inputs()

    def step(t: Any) -> torch.Tensor:
        return fused_head(h, w, y, backend="floor-test", temperature=t).log_probs

    compiled = compile_symbolic(step, 0.7, 0.5, 0.3)
    assert_same_refusal(
        compiled, step, 0.125, CapabilityError, "min_temperature=0.25", "got temperature=0.125"
    )


# --- the policy loss's floats ---------------------------------------------------------------------


def policy_inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden": torch.randn(2, 3, 8, generator=g),
        "weight": torch.randn(12, 8, generator=g) / 3,
        "labels": torch.randint(0, 12, (2, 3), generator=g),
        "old_log_probs": torch.randn(2, 3, generator=g) - 2,
        "advantages": torch.randn(2, 1, generator=g),
    }


@pytest.mark.parametrize(
    ("arg", "goods", "bad", "names"),
    [
        ("clip_low", (0.2, 0.1), -0.1, "clip_low must be a finite float >= 0, got -0.1"),
        ("clip_high", (0.2, 0.3), -0.5, "clip_high must be a finite float >= 0, got -0.5"),
        ("entropy_coef", (0.01, 0.02), 1e39, "entropy_coef must be a finite float and at most"),
        ("kl_coef", (0.01, 0.02), -1.0, "kl_coef must be a finite float >= 0, got -1.0"),
        ("dual_clip", (3.0, 2.5), 1.0, "dual_clip must be > 1 (verl's clip_ratio_c), got 1.0"),
        ("loss_normalizer", (4.0, 5.0), 1e-20, "loss_normalizer must be a count > 0"),
        ("temperature", (0.7, 0.5), TORCH_FLOOR / 8, "got temperature=9.860761315262648e-32"),
    ],
)
def test_policy_loss_floats(arg: str, goods: tuple[float, float], bad: float, names: str) -> None:
    """``fused_policy_loss`` never compiles whole (its backend runs behind a graph break, and
    fullgraph says so on every call), but its arguments are checked before that break: a bad one
    is refused first, by name, symbolic or not."""
    data = policy_inputs()
    extra: dict[str, Any] = {"ref_log_probs": data["old_log_probs"]} if arg == "kl_coef" else {}

    def step(v: Any) -> torch.Tensor:
        return fused_policy_loss(**data, **extra, **{arg: v}).loss

    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, backend="eager", fullgraph=True)
        for good in goods:  # each stops at the graph break, the value traced (then symbolic)
            with pytest.raises(
                Exception, match=r"(?s)fused_policy_loss .*compile without fullgraph"
            ):
                compiled(good)
        want = eager_refusal(step, bad)
        assert want[0] == ("CapabilityError" if arg == "temperature" else "ValueError"), want
        with pytest.raises(Exception) as info:
            compiled(bad)
        got = refusal(info.value)
        assert got == want, f"compiled: {got}\neager:    {want}"
        assert names in got[1], got
    finally:
        torch._dynamo.reset()
