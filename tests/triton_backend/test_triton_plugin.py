"""The plugin surface: entry point, cheap import, options, capabilities, check() and the core."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
from pydantic import ValidationError

from fusedhead.errors import BackendUnavailableError
from fusedhead_triton import TritonBackend, TritonOptions


def test_entry_point_names_the_backend_class() -> None:
    eps = [ep for ep in entry_points(group="fusedhead.backends") if ep.name == "triton"]
    assert [ep.value for ep in eps] == ["fusedhead_triton:TritonBackend"]
    assert TritonBackend.name == "triton"
    assert TritonBackend.plugin_api_version == 2


def test_import_does_not_import_triton() -> None:
    code = "import sys, fusedhead_triton; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_options_are_validated() -> None:
    assert TritonOptions().memory == "low"
    assert TritonOptions().backward_block_mib is None  # memory's default
    with pytest.raises(ValidationError, match="memory"):
        TritonOptions(memory="medium")
    with pytest.raises(ValidationError, match="backward_block_mib"):
        TritonOptions(backward_block_mib=0)
    with pytest.raises(ValidationError, match="power"):
        TritonOptions(block_m=24)
    with pytest.raises(ValidationError):
        TritonOptions(block_n=8)
    with pytest.raises(ValidationError):
        TritonOptions(not_an_option=1)
    for gone in ("dh_gemm", "dh_sum", "stash_dh_sum", "lend_dw_rows", "backward_block_max_cols"):
        with pytest.raises(ValidationError, match=gone):
            TritonOptions(**{gone: True})


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("block_n", 2**40, ["option 'block_n' = 1099511627776", "powers of two from 16 to 1024"]),
        ("block_m", 2048, ["option 'block_m' = 2048", "powers of two from 16 to 1024"]),
        ("backward_block_mib", float("inf"), ["option 'backward_block_mib' = inf", "finite"]),
        ("backward_block_mib", float("nan"), ["option 'backward_block_mib' = nan", "finite"]),
        ("backward_block_mib", 1e308, ["option 'backward_block_mib' = 1e+308", "<= 1048576"]),
    ],
)
def test_options_a_kernel_cannot_take_are_refused_by_name(
    option: str, value: object, words: list[str]
) -> None:
    """Before: a 2**40 tile reached the interpreter (an int32 overflow, on a GPU a compile
    failure) and an infinite or a finite huge buffer bound an OverflowError in the first call."""
    import fusedhead
    from fusedhead.errors import OptionsError

    h, w, y = torch.randn(4, 16), torch.randn(32, 16), torch.zeros(4, dtype=torch.long)
    with pytest.raises(OptionsError) as info:
        fusedhead.fused_head(h, w, y, backend="triton", options={option: value})
    for word in words:
        assert word in str(info.value)
    TritonOptions(block_m=1024, block_n=1024, block_k=1024, backward_block_mib=1e-3)  # the ends
    TritonOptions(backward_block_mib=2**20)


def test_one_memory_choice_and_tile_overrides() -> None:
    """Every option is the memory-or-speed choice or a tuning override."""
    assert set(TritonOptions.model_fields) == {
        "memory", "backward_block_mib", "block_m", "block_n", "block_k", "tma", "policy_chunk_rows",
    }  # fmt: skip


def test_capabilities_under_the_interpreter() -> None:
    caps = TritonBackend().capabilities(torch.device("cpu"))
    assert caps.devices == ("cuda", "cpu")
    assert caps.dtypes == ("fp32", "fp16")
    assert caps.batch_invariant and caps.deterministic and caps.vocab_parallel
    assert caps.per_token_temperature and caps.softcap and caps.uneven_shards
    assert caps.entropy_precision == "fp32" and caps.logits_precision == "fp32"


def test_capabilities_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    caps = TritonBackend().capabilities(torch.device("cuda"))
    assert caps.devices == ("cuda",)
    assert caps.dtypes == ("fp32", "fp16", "bf16")


def test_check_on_the_cpu_without_the_interpreter_says_how(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendUnavailableError) as err:
        TritonBackend().check(torch.device("cpu"), torch.float32)
    assert "TRITON_INTERPRET=1" in str(err.value) and "backend='torch'" in str(err.value)
    # bf16: the interpreter refuses it (its bf16 dots are wrong), so torch is the advice
    with pytest.raises(BackendUnavailableError) as err:
        TritonBackend().check(torch.device("cpu"), torch.bfloat16)
    assert str(err.value).endswith(
        "use backend='torch' (or, in fp32 or fp16, set TRITON_INTERPRET=1 to test the kernels "
        "on the CPU's interpreter)"
    ), err.value


def test_check_refuses_bf16_under_the_interpreter() -> None:
    TritonBackend().check(torch.device("cpu"), torch.float32)
    TritonBackend().check(torch.device("cpu"), torch.float16)
    with pytest.raises(BackendUnavailableError, match="bf16"):
        TritonBackend().check(torch.device("cpu"), torch.bfloat16)


def test_check_refuses_other_devices_and_dtypes() -> None:
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        TritonBackend().check(torch.device("meta"), torch.float32)
    with pytest.raises(BackendUnavailableError, match="fp32, fp16 or bf16"):
        TritonBackend().check(torch.device("cpu"), torch.float64)


def test_check_refuses_cuda_while_the_interpreter_is_on() -> None:
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        TritonBackend().check(torch.device("cuda"), torch.bfloat16)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_check_without_cuda_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendUnavailableError, match="no CUDA device"):
        TritonBackend().check(torch.device("cuda"), torch.bfloat16)


def test_an_interpreter_that_cannot_run_the_kernels_is_a_reason_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Triton 3.6's interpreter under NumPy 2.4 fails inside every persistent loop
    (triton-lang/triton#9171): the backend says so, with the versions and the fix, before a call."""
    import fusedhead
    from fusedhead_triton import interpreter_probe

    def numpy_24_under_triton_36() -> None:
        raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

    monkeypatch.setattr(interpreter_probe, "_run_probe", numpy_24_under_triton_36)
    interpreter_probe.forget()
    try:
        with pytest.raises(BackendUnavailableError, match=r"interpreter fails under NumPy .*9171"):
            TritonBackend().check(torch.device("cpu"), torch.float32)
        head = fusedhead.FusedHead(backend="triton")  # its own check: a head's first call's
        h, w = torch.randn(4, 8), torch.randn(16, 8)
        with pytest.raises(BackendUnavailableError, match=r"0-dimensional.*backend='torch'"):
            head(h, w, torch.zeros(4, dtype=torch.long))
    finally:
        interpreter_probe.forget()


def test_another_probe_failure_is_reported_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    from fusedhead_triton import interpreter_probe

    def broken() -> None:
        raise RuntimeError("something else")

    monkeypatch.setattr(interpreter_probe, "_run_probe", broken)
    interpreter_probe.forget()
    try:
        problem = interpreter_probe.interpreter_problem()
        assert problem is not None and "RuntimeError: something else" in problem
        assert "NumPy" not in problem and "9171" not in problem
    finally:
        interpreter_probe.forget()


def test_the_probe_is_one_verdict_across_threads() -> None:
    """The interpreter patches triton.language for the process: concurrent asks wait, agree."""
    from concurrent.futures import ThreadPoolExecutor

    from fusedhead_triton import interpreter_probe

    interpreter_probe.forget()
    with ThreadPoolExecutor(8) as pool:
        verdicts = set(pool.map(lambda _: interpreter_probe.interpreter_problem(), range(64)))
    assert len(verdicts) == 1


def test_through_the_core_api() -> None:
    """fusedhead.fused_head(backend="triton") validates, reshapes 3-D inputs and differentiates."""
    import fusedhead
    from fusedhead.reference import reference_fused_head

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 9, 40, generator=g, requires_grad=True)
    w = (torch.randn(300, 40, generator=g) / 40**0.5).requires_grad_()
    lab = torch.randint(0, 300, (2, 9), generator=g)
    lab[0, 3] = -100
    out = fusedhead.fused_head(h, w, lab, backend="triton", temperature=0.7)
    assert out.log_probs.shape == (2, 9) and out.entropy.shape == (2, 9)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    hr = h.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    rl, re = reference_fused_head(hr, wr, lab, temperature=0.7, compute_dtype=torch.float64)
    (rl.sum() + re.sum()).backward()
    assert torch.allclose(out.log_probs.double(), rl, rtol=0, atol=1e-5)
    assert torch.allclose(h.grad.double(), hr.grad, rtol=0, atol=1e-5)
    assert torch.allclose(w.grad.double(), wr.grad, rtol=0, atol=1e-5)
