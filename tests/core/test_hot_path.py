"""The per-call path's shortcuts give what the full checks give: the same call, the same refusals.

The core reads each tensor property once per call and checks a backend's output in one expression,
leaving any doubt to the full output check; these tests pin that the shortcuts neither let a broken
output through nor refuse a sound one, and that nothing checked once is frozen for later calls.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fusedhead import FusedHead, fused_head, registry
from fusedhead.errors import BackendContractError, BackendUnavailableError, CapabilityError
from fusedhead.protocol import HeadCall, HeadOutput
from fusedhead.request import HeadRequest
from fusedhead.validation import _HEAD_CALL_FIELDS, check_head

REPO = Path(__file__).resolve().parents[2]


class _Sub(torch.Tensor):
    """A tensor subclass: not ``torch.Tensor`` exactly, so the short output check defers."""


def _good(call: HeadCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Sound fp32 [N] outputs attached to the graph of hidden and weight."""
    zero = call.hidden.float().sum(-1) * 0 + call.weight.float().sum() * 0
    return zero, zero + 1


#: Broken outputs, each a function of the call the backend received.
BROKEN: dict[str, Callable[[HeadCall], object]] = {
    "not a HeadOutput": lambda c: _good(c),
    "None": lambda c: None,
    "log_probs None": lambda c: HeadOutput(None, _good(c)[1]),  # type: ignore[arg-type]
    "log_probs a list": lambda c: HeadOutput(_good(c)[0].tolist(), _good(c)[1]),  # type: ignore[arg-type]
    "float64": lambda c: HeadOutput(_good(c)[0].double(), _good(c)[1]),
    "bf16 entropy": lambda c: HeadOutput(_good(c)[0], _good(c)[1].bfloat16()),
    "one row short": lambda c: HeadOutput(_good(c)[0][:-1], _good(c)[1][:-1]),
    "2-d [1, N]": lambda c: HeadOutput(_good(c)[0][None], _good(c)[1][None]),
    "log_probs one row short": lambda c: HeadOutput(_good(c)[0][:-1], _good(c)[1]),
    "log_probs [N, 1]": lambda c: HeadOutput(_good(c)[0][:, None], _good(c)[1]),
    "entropy one row short": lambda c: HeadOutput(_good(c)[0], _good(c)[1][:-1]),
    "entropy [N, 1]": lambda c: HeadOutput(_good(c)[0], _good(c)[1][:, None]),
    "on meta": lambda c: HeadOutput(_good(c)[0].to("meta"), _good(c)[1]),
    "entropy on meta": lambda c: HeadOutput(_good(c)[0], _good(c)[1].to("meta")),
    "lse not asked for": lambda c: HeadOutput(*_good(c), lse=_good(c)[0]),
    "gathered not asked for": lambda c: HeadOutput(*_good(c), gathered=_good(c)[0][:, None]),
}


def _entropy_rule(want_entropy: bool) -> Callable[[HeadCall], object]:
    """The output that breaks the entropy rule of the call: missing when asked, set when not."""
    if want_entropy:
        return lambda c: HeadOutput(_good(c)[0])
    return lambda c: HeadOutput(*_good(c))


@pytest.fixture
def patch_forward(ref_backend: Any, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    def patch(make: Callable[[HeadCall], object]) -> None:
        monkeypatch.setattr(ref_backend, "forward", lambda self, call: make(call))

    return patch


@pytest.mark.parametrize("leading", [(6,), (2, 3)], ids=["labels [N]", "labels [B, T]"])
@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "log-probs only"])
@pytest.mark.parametrize("kind", [*BROKEN, "entropy rule"])
def test_every_broken_output_is_caught_on_the_short_path(
    patch_forward, inputs, kind, entropy, grad, leading
):
    h, w, y = inputs()
    h, y = h.reshape(*leading, 8), y.reshape(leading)
    w.requires_grad_(grad)
    patch_forward(_entropy_rule(entropy) if kind == "entropy rule" else BROKEN[kind])
    with pytest.raises(BackendContractError, match="broke the plugin contract") as info:
        fused_head(h, w, y, backend="ref-test", return_entropy=entropy)
    assert info.value.backend == "ref-test"
    with pytest.raises(BackendContractError, match="broke the plugin contract"):
        FusedHead(backend="ref-test")(h, w, y, return_entropy=entropy)


def test_a_detached_output_is_caught_only_where_a_gradient_is_due(patch_forward, inputs):
    h, w, y = inputs()
    patch_forward(lambda c: HeadOutput(*(t.detach() for t in _good(c))))
    fused_head(h, w, y, backend="ref-test")  # nothing requires grad: detached is right
    w.requires_grad_(True)
    with torch.no_grad():
        fused_head(h, w, y, backend="ref-test")  # no graph is built: detached is right
    with pytest.raises(BackendContractError, match="log_probs does not require grad"):
        fused_head(h, w, y, backend="ref-test")
    patch_forward(lambda c: HeadOutput(_good(c)[0].detach(), _good(c)[1]))
    with pytest.raises(BackendContractError, match="log_probs does not require grad"):
        fused_head(h, w, y, backend="ref-test", return_entropy=False)
    with pytest.raises(BackendContractError, match="log_probs does not require grad"):
        fused_head(h, w, y, backend="ref-test")
    patch_forward(lambda c: HeadOutput(_good(c)[0], _good(c)[1].detach()))
    with pytest.raises(BackendContractError, match="entropy does not require grad"):
        fused_head(h, w, y, backend="ref-test")


@pytest.mark.parametrize("leading", [(6,), (2, 3)], ids=["labels [N]", "labels [B, T]"])
def test_sound_outputs_the_short_check_defers_are_accepted(patch_forward, inputs, leading):
    """Tensor subclasses and a HeadOutput subclass fail the exact-class test, not the contract."""

    class Output(HeadOutput):
        pass

    h, w, y = inputs()
    h, y = h.reshape(*leading, 8), y.reshape(leading)
    w.requires_grad_(True)
    for make in (
        lambda c: HeadOutput(*(t.as_subclass(_Sub) for t in _good(c))),
        lambda c: Output(*_good(c)),
    ):
        patch_forward(make)
        out = fused_head(h, w, y, backend="ref-test")
        assert out.log_probs.shape == leading and out.entropy is not None
        assert torch.equal(out.log_probs, torch.zeros(leading))
        assert torch.equal(out.entropy, torch.ones(leading))
        out.log_probs.sum().backward()
        assert w.grad is not None


def test_an_output_in_the_labels_shape_is_not_a_view(ref_backend, inputs):
    h, w, y = inputs()
    out = fused_head(h.reshape(2, 3, 8), w, y.reshape(2, 3), backend="ref-test")
    assert out.log_probs.shape == (2, 3) and out.log_probs._base is None
    assert out.entropy is not None and out.entropy._base is None
    flat = fused_head(h, w, y, backend="ref-test")
    assert torch.equal(out.log_probs.reshape(-1), flat.log_probs)


def _call(**kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "temperature": 1.0,
        "ignore_index": -100,
        "return_entropy": True,
        "process_group": None,
        "vocab_start": None,
        "vocab_size": None,
        "reduce_hidden_grad": True,
        "check_labels": True,
        "softcap": None,
    }
    return {**args, **kw}


def _same_call(a: HeadCall, b: HeadCall) -> None:
    assert a._fields == b._fields
    for field, x, y in zip(a._fields, a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), field
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), field
            assert x.is_contiguous() == y.is_contiguous(), field
        else:
            assert type(x) is type(y) and x == y, field


@pytest.mark.parametrize(
    "case",
    ["2-d", "3-d int32 labels", "strided labels", "log-probs only", "softcap", "int temperature"],
)
def test_validate_builds_the_call_the_fields_name(inputs, case):
    h, w, y = inputs(n=12)
    kw = _call()
    if case == "3-d int32 labels":
        h, y = h.reshape(3, 4, 8), y.reshape(3, 4).int()
    elif case == "strided labels":
        y = torch.stack([y, y], 1)[:, 0]
        assert not y.is_contiguous()
    elif case == "log-probs only":
        kw["return_entropy"] = False
    elif case == "softcap":
        kw["softcap"] = 30
    elif case == "int temperature":
        kw["temperature"] = 2
    call, shape, n, device, dtype, cast = check_head(HeadRequest(h, w, y, **kw))[:6]
    want = HeadCall(
        hidden=h.reshape(-1, 8),
        weight=w,
        labels=y.reshape(-1).to(torch.int64).contiguous(),
        temperature=float(kw["temperature"]),
        softcap=None if kw["softcap"] is None else float(kw["softcap"]),
        ignore_index=-100,
        vocab_start=0,
        vocab_size=11,
        process_group=None,
        reduce_hidden_grad=True,
        outputs=frozenset({"log_probs", "entropy"} if kw["return_entropy"] else {"log_probs"}),
    )
    _same_call(call, want)
    assert call.labels.is_contiguous()
    assert tuple(shape) == tuple(y.shape) and n == 12
    assert device == h.device and dtype == torch.float32 and cast is None
    assert HeadCall._fields == _HEAD_CALL_FIELDS


def test_autocast_is_read_on_every_call_and_off_inside_the_backend(
    ref_backend, inputs, monkeypatch
):
    h, w, y = inputs()
    seen: list[tuple[torch.dtype, bool]] = []
    forward = ref_backend.forward

    def spy(self: Any, call: HeadCall) -> HeadOutput:
        seen.append((call.hidden.dtype, torch.is_autocast_enabled("cpu")))
        return forward(self, call)

    monkeypatch.setattr(ref_backend, "forward", spy)
    fused_head(h, w, y, backend="ref-test")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_head(h, w, y, backend="ref-test")
    fused_head(h, w, y, backend="ref-test")
    meta = [t.to("meta") for t in (h, w, y)]
    fused_head(*meta, backend="ref-test")  # a device type autocast has no state for
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_head(*meta, backend="ref-test")  # the CPU's autocast is not the call's: left on
    assert seen == [
        (torch.float32, False),
        (torch.bfloat16, False),
        (torch.float32, False),
        (torch.float32, False),
        (torch.float32, True),
    ]


def test_plain_calls_are_still_refused_what_the_backend_does_not_declare(ref_backend, inputs):
    h, w, y = inputs()
    ref_backend.caps = {"outputs": ("log_probs",)}
    fused_head(h, w, y, backend="ref-test", return_entropy=False)
    with pytest.raises(CapabilityError, match=r"requested outputs \['entropy'\]"):
        fused_head(h, w, y, backend="ref-test")
    with pytest.raises(CapabilityError, match="per_token_temperature"):
        fused_head(h, w, y, backend="ref-test", return_entropy=False, temperature=torch.ones(6))
    with pytest.raises(CapabilityError, match="softcap"):
        fused_head(h, w, y, backend="ref-test", return_entropy=False, softcap=5.0)


def test_the_backend_check_runs_once_per_device_and_dtype(ref_backend, inputs, monkeypatch):
    checked: list[torch.dtype] = []

    def check(self: Any, device: torch.device, dtype: torch.dtype) -> None:
        checked.append(dtype)
        if dtype == torch.bfloat16:
            raise BackendUnavailableError("no bf16 here", hint="use fp32")

    monkeypatch.setattr(ref_backend, "check", check)
    h, w, y = inputs()
    head = FusedHead(backend="ref-test")
    for _ in range(3):
        head(h, w, y)
    for _ in range(2):
        with pytest.raises(BackendUnavailableError, match="no bf16 here"):
            head(h.bfloat16(), w.bfloat16(), y)
    head(h, w, y)
    assert checked == [torch.float32, torch.bfloat16, torch.bfloat16]


def test_the_overhead_script_runs_and_reports_the_figure(capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import core_overhead

        args = ["--backend", "null", "--calls", "20", "--runs", "4", "--json"]
        assert core_overhead.main(args) == 0
    finally:
        sys.path.pop(0)
        registry.unregister_backend(core_overhead.NullBackend.name)
        registry.refresh()
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == "null" and result["runs"] == "4x20"
    assert result["fused_head_us"] > result["bare_us"] > 0
    assert result["overhead_us"] == pytest.approx(
        result["fused_head_us"] - result["bare_us"], abs=0.11
    )
    assert len(result["halves_us"]) == 2
