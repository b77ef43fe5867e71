"""``fusedhead info NAME`` says per device what a backend declares (issue 34).

Capabilities differ by device (triton's bf16 is CUDA-only); one device's list printed alone read
as the backend's on a CPU login node.
"""

from __future__ import annotations

import json

import pytest
import torch

from fusedhead import cli


def _info(capsys: pytest.CaptureFixture[str], *args: str) -> dict:  # type: ignore[type-arg]
    assert cli.main(["info", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only view")
def test_triton_on_a_cpu_machine_lists_cudas_bf16_too(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = _info(capsys, "triton")
    assert out["device"] == "cpu" and "bf16" not in out["capabilities"]["dtypes"]
    per = out["per_device"]
    assert set(per) == {"cpu", "cuda"}
    assert "bf16" in per["cuda"]["dtypes"] and per["cuda"]["runs_on_it"]
    assert not per["cpu"]["runs_on_it"] and per["cpu"]["status"] == "unavailable"
    assert per["cuda"]["status"] == "unavailable" and "CUDA" in per["cuda"]["reason"]
    # the same dtypes and statuses whichever device is shown
    again = _info(capsys, "triton", "--device", "cuda")["per_device"]
    for kind in per:
        assert {k: v for k, v in again[kind].items() if k != "differs"} == {
            k: v for k, v in per[kind].items() if k != "differs"
        }
    assert cli.main(["info", "triton"]) == 0
    text = capsys.readouterr().out
    assert "per device" in text and "  cuda: dtypes fp32, fp16, bf16; status unavailable" in text


def test_torch_runs_on_the_cpu_in_every_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    per = _info(capsys, "torch", "--device", "cpu")["per_device"]
    assert per["cpu"] == {"runs_on_it": True, "dtypes": ["fp32", "fp16", "bf16"], "status": "ok"}
