"""The torch backend as a plugin: options, capabilities, check, registration, and via fused_head."""

from __future__ import annotations

from importlib.metadata import entry_points

import pydantic
import pytest
import torch
from torch_backend_helpers import IGNORE, Result, assert_close, make_case, run_reference

from fusedhead.errors import BackendUnavailableError
from fusedhead.protocol import PLUGIN_API_VERSION, FusedHeadBackend
from fusedhead_torch import TorchBackend, TorchOptions


def test_registered_under_its_name_by_entry_point() -> None:
    (ep,) = [e for e in entry_points(group="fusedhead.backends") if e.name == "torch"]
    assert ep.value == "fusedhead_torch:TorchBackend"
    assert ep.load() is TorchBackend
    assert TorchBackend.name == "torch"
    assert TorchBackend.plugin_api_version == PLUGIN_API_VERSION
    assert isinstance(TorchBackend(TorchOptions()), FusedHeadBackend)


@pytest.mark.parametrize(
    "bad",
    [
        {"chunk_rows": 0},
        {"block_vocab": -3},
        {"workspace_mib": 0},
        {"chunk_rows": "many"},
        {"tile": 4},
    ],
)
def test_options_are_validated(bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        TorchOptions(**bad)


def test_options_defaults_and_round_trip() -> None:
    opts = TorchOptions(block_vocab=4096)
    assert TorchOptions.model_validate(opts.model_dump()) == opts
    assert TorchOptions().model_dump() == {
        "workspace_mib": None,
        "block_vocab": None,
        "chunk_rows": None,
        "skip_ignored_rows": None,
        "fp32_logits": None,
        "compile_elementwise": None,
    }


def test_capabilities() -> None:
    caps = TorchBackend(TorchOptions()).capabilities(torch.device("cpu"))
    assert set(caps.devices) == {"cpu", "cuda"}
    assert set(caps.dtypes) == {"fp32", "fp16", "bf16"}
    assert caps.vocab_parallel and caps.uneven_shards and caps.deterministic
    assert caps.per_token_temperature and caps.softcap
    assert not caps.batch_invariant
    assert caps.entropy_precision == "fp32"


@pytest.mark.parametrize("device", ["mps", "xpu", "meta"])
def test_check_refuses_other_device_types(device: str) -> None:
    with pytest.raises(BackendUnavailableError, match=device):
        TorchBackend(TorchOptions()).check(torch.device(device), torch.float32)


def test_check_refuses_other_dtypes() -> None:
    with pytest.raises(BackendUnavailableError, match="float64"):
        TorchBackend(TorchOptions()).check(torch.device("cpu"), torch.float64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_check_refuses_cuda_without_a_device() -> None:
    with pytest.raises(BackendUnavailableError, match="cuda"):
        TorchBackend(TorchOptions()).check(torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_check_accepts_the_cpu(dtype: torch.dtype) -> None:
    TorchBackend(TorchOptions()).check(torch.device("cpu"), dtype)


def test_through_fused_head_with_3d_inputs_and_options() -> None:
    from fusedhead import fused_head

    case = make_case(24, 16, 60)
    hidden = case.hidden.float().view(4, 6, 16).requires_grad_()
    weight = case.weight.float().requires_grad_()
    out = fused_head(
        hidden,
        weight,
        case.labels.view(4, 6),
        backend="torch",
        temperature=0.7,
        ignore_index=IGNORE,
        options={"block_vocab": 16, "chunk_rows": 5},
    )
    assert out.log_probs.shape == (4, 6) and out.entropy.shape == (4, 6)
    loss = (out.log_probs.double().view(-1) * case.g_lp).sum()
    (loss + (out.entropy.double().view(-1) * case.g_ent).sum()).backward()
    got = Result(
        out.log_probs.detach().view(-1),
        out.entropy.detach().view(-1),
        hidden.grad.view(24, 16),
        weight.grad,
    )
    assert_close(got, run_reference(case), "fp32", "fused_head")


def test_through_fused_head_with_per_token_temperature_and_softcap() -> None:
    from fusedhead import fused_head

    case = make_case(20, 16, 50)
    temps = torch.linspace(0.2, 4.0, 20)
    out = fused_head(
        case.hidden.float(),
        case.weight.float(),
        case.labels,
        backend="torch",
        temperature=temps,
        softcap=3.0,
        check_labels=False,
    )
    want = run_reference(case, temperature=temps, softcap=3.0)
    assert_close(Result(out.log_probs, out.entropy, None, None), want, "fp32", "fused_head")
