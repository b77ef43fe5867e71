"""The head cases' own inputs (the KL teacher, the gather ids) and the backends' declared limits:
a real teacher, inputs made before the measured step, every declared limit a skip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from fusedhead import cli
from fusedhead.bench import heads, measure, memory
from fusedhead.bench.cases import IGNORE_INDEX, Case, make_inputs
from fusedhead.protocol import Capabilities

SMALL = ["--n", "64", "--hidden", "32", "--device", "cpu", "--reps", "1", "--no-memory"]


@pytest.fixture
def torch_backend() -> None:
    pytest.importorskip("fusedhead_torch", reason="needs fusedhead-torch installed")


class _Teacher:
    """A stand-in ``FusedHead`` that keeps the teacher the ``kl`` case passes it."""

    def kl(self, h: torch.Tensor, w: torch.Tensor, th: torch.Tensor, tw: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:  # fmt: skip
        self.hidden, self.weight = th, tw
        return torch.zeros(h.shape[0])


@pytest.mark.parametrize("kind", ["kl", "kl-reverse"])
def test_the_kl_teacher_is_a_head_of_its_own_not_a_one_hot(kind: str) -> None:
    """Before: the teacher's weight and hidden states came from two generators of one seed, so
    hidden row i was weight row i scaled: its argmax was the row index in every row, max p ~1."""
    case = Case(64, 32, 300, head=kind)
    inputs = make_inputs(case)
    teacher = _Teacher()
    fn = heads.build(kind, case, teacher, case.temperature, IGNORE_INDEX)
    fn(inputs.hidden, inputs.weight, inputs.labels)
    assert teacher.hidden.shape == inputs.hidden.shape
    assert teacher.weight.shape == inputs.weight.shape
    p = torch.softmax((teacher.hidden @ teacher.weight.T).double(), dim=-1)
    at_own_row = (p.argmax(-1) == torch.arange(case.n)).float().mean().item()
    assert at_own_row < 0.1  # about 1 / V for a head drawn independently of its hidden states
    assert p.max(-1).values.median().item() < 0.5  # spread over many ids, not one-hot
    assert not torch.equal(teacher.hidden, inputs.hidden)  # nor the student's own rows


_DRAWS = {"randn", "rand", "randint", "randperm", "normal_", "uniform_", "random_", "bernoulli"}


class _Draws(TorchFunctionMode):
    """The random draws (the way every input of a case is made) that torch functions make."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in _DRAWS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("head", ["logprobs", "kl", "kl-reverse", "gather5", "topk4", "policy"])
def test_the_cpu_memory_step_draws_no_input_of_its_case(
    torch_backend: None, head: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the CPU memory child warmed up on 64 rows, so the kl and gather cases drew their
    full-size teacher hidden states and ids inside the measured step and counted them as the
    step's memory (128 MiB for kl at N=8192, H=1024, V=64; 96 MiB with them made before)."""
    draws: list[list[str]] = []

    def measured(step: Any) -> int:  # the measured window of the child, where it is taken
        with _Draws() as mode:
            step()
        draws.append(mode.seen)
        return 0

    monkeypatch.setattr(memory, "cpu_peak_extra_bytes", measured)
    case = Case(96, 16, 300, head=head)  # more rows than the child's warm-up of 64
    assert measure._child(json.dumps({"case": case.to_dict(), "impl": "torch"})) == 0
    assert draws == [[]]


def test_every_declared_limit_is_a_refusal_with_its_reason() -> None:
    """Before: max_top_k and min_temperature were not checked, so the call's CapabilityError
    was recorded as an error where every other declared limit is a skip."""
    caps = Capabilities(outputs=("log_probs", "entropy", "topk"), max_top_k=4096)
    assert heads.refusal("topk4096", caps) is None
    assert "max_top_k" in (heads.refusal("topk4097", caps) or "")
    floor = Capabilities(min_temperature=1e-3, kl_directions=("forward",))
    assert heads.refusal("logprobs", floor, temperature=1e-3) is None
    assert "min_temperature=0.001" in (heads.refusal("logprobs", floor, temperature=1e-4) or "")
    assert "min_temperature" in (heads.refusal("kl", floor, temperature=1e-4) or "")
    teacher = Capabilities(min_temperature=2.0, kl_directions=("forward",))  # the teacher's is 1
    assert "teacher temperature is 1" in (heads.refusal("kl", teacher, temperature=3.0) or "")


@pytest.mark.parametrize(
    ("argv", "limit"),
    [
        (["--case", "topk4097", "--vocab", "5000"], "max_top_k"),
        (["--temperature", "1e-37", "--vocab", "500"], "min_temperature"),
        (["--temperature", "1e-37", "--vocab", "500", "--case", "kl"], "min_temperature"),
    ],
)
def test_a_case_past_a_declared_limit_is_recorded_as_skipped(
    torch_backend: None, argv: list[str], limit: str, tmp_path: Path
) -> None:
    """Before: these recorded status 'error' (CapabilityError) and counted as failures."""
    out = tmp_path / "r.json"
    assert cli.main(["bench", *SMALL, *argv, "--impl", "torch", "--json", str(out)]) == 1
    (record,) = json.loads(out.read_text())  # exit 1: nothing was measured
    assert record["status"] == "skipped" and "error" not in record, record
    assert limit in record["reason"] and record["reason"].startswith("backend 'torch'")


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("unfused:unfused:torch", "unfused: is given twice"),
        ("unfused:torch:[1]", "must be a JSON object, got a JSON array"),
        ("unfused:torch:{", "must be a JSON object (Expecting property name"),
    ],
)
def test_an_unfused_spec_is_named_as_given_with_what_is_wrong(
    spec: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: unfused:unfused:torch read "--impl 'unfused:torch': options after ':' must be a
    JSON object", another spec than the one given and another cause."""
    assert cli.main(["bench", *SMALL, "--vocab", "500", "--case", "policy", "--impl", spec]) == 2
    err = capsys.readouterr().err
    assert f"--impl {spec!r}: " in err and why in err, err
