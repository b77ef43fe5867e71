"""``fusedhead bench --case``: the issue-18 head cases run on fusedhead backends, peers skip them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusedhead import cli
from fusedhead.bench import heads
from fusedhead.protocol import Capabilities

TINY = ["--device", "cpu", "--n", "40", "--hidden", "16", "--vocab", "300", "--reps", "1"]


@pytest.mark.slow
def test_bench_times_each_head_case_on_torch_and_skips_peers(tmp_path: Path) -> None:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    cases = ["logprobs", "topk8", "gather5", "lse", "sum_p2", "argmax", "kl", "kl-reverse"]
    # Memory is measured in a fresh process per measurement: two cases carry that path, the
    # others are appended to the same results without it.
    measured = ["logprobs", "kl-reverse"]
    argv = ["bench", *TINY, "--impl", "torch", "reference", "--json", str(out)]
    assert cli.main([*argv, "--case", *measured]) == 0
    rest = [c for c in cases if c not in measured]
    assert cli.main([*argv, "--case", *rest, "--no-memory", "--append", "--markdown", str(md)]) == 0
    records = json.loads(out.read_text())
    got = {(r["case"]["head"], r["impl"]): r for r in records}
    assert set(got) == {(c, i) for c in cases for i in ("torch", "reference")}
    for case in cases:
        r = got[(case, "torch")]
        assert r["status"] == "ok", r
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
        if case in measured:  # tiny cases may reuse freed heap: any int
            assert isinstance(r["peak_extra_bytes"], int), r
        else:
            assert r.get("peak_extra_bytes") is None, r
        peer = got[(case, "reference")]
        assert peer["status"] == ("ok" if case == "logprobs" else "skipped")
    assert "errors" in got[("logprobs", "torch")] and "errors" not in got[("kl", "torch")]
    table = md.read_text()
    assert "| torch topk8 |" in table and "| torch kl-reverse |" in table and "| torch |" in table


def test_a_backend_without_the_output_is_skipped_with_the_reason() -> None:
    caps = Capabilities(outputs=("log_probs", "entropy"))
    assert heads.refusal("logprobs", caps) is None
    assert "'topk'" in (heads.refusal("topk32", caps) or "")
    assert "forward KL" in (heads.refusal("kl", caps) or "")
    assert heads.refusal("kl-reverse", Capabilities(kl_directions=("reverse",))) is None


@pytest.mark.parametrize("name", ["topk", "topk0", "gather", "kl-forward", "top32"])
def test_bad_case_names_are_errors_naming_the_flag(name: str) -> None:
    with pytest.raises(ValueError, match="--case"):
        heads.parse(name)
    assert cli.main(["bench", *TINY, "--impl", "torch", "--case", name]) == 2
