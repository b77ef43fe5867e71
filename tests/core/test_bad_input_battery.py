"""Bad calls found by a battery across the public surface, one test per class (the rule, not the
one example). Each refusal names the argument, what it got and what was expected.

- A per-token temperature of fewer dimensions than the labels (``[B]`` or ``[S]`` beside
  ``[B, S]``): ``fused_head`` refused it, but ``lm_head_logprobs``, ``causal_lm_logprobs`` and the
  yardstick ``reference_fused_head`` broadcast it along S (B == S: no error, each position got the
  temperature of another row). Each now refuses it as ``fused_head`` does; ``[B, 1]`` runs.
- A key given twice in a YAML config or a JSON object of options (the CLI's ``--options``,
  bench's ``--impl NAME:{...}``, the kit's options, TRL's ``fused_head_options``) was taken as
  its last value silently; refused, naming the key. A config file that is not UTF-8 gave a bare
  ``UnicodeDecodeError``; a ``ValueError`` naming the file.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusedhead
from fusedhead import cli
from fusedhead.bench.peers import parse_spec
from fusedhead.integrations.lm_head import lm_head_logprobs
from fusedhead.integrations.transformers import causal_lm_logprobs
from fusedhead.testing.target import parse_options

B, S, H, V = 3, 3, 8, 11  # B == S: a [B] tensor broadcast to [B, S] goes along S unnoticed
RANK = r"temperature tensor of shape \(3,\) must have the labels' number of dimensions"


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, S, H, generator=g),
        torch.randn(V, H, generator=g),
        torch.randint(0, V, (B, S), generator=g),
    )


def _linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(H, V, bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return lin


class _TinyLM(nn.Module):
    """Enough of a causal LM for the arguments' checks (they run before the decoder)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(H, V, bias=False)


TEMPERATURE = torch.tensor([0.5, 1.0, 2.0])


@pytest.mark.parametrize("select_rows", [True, False])
def test_lm_head_logprobs_refuses_a_temperature_of_fewer_dimensions(select_rows):
    """Before: log-probs off by up to 8.6 (the temperatures of [B] laid along S)."""
    h, w, y = _inputs()
    with pytest.raises(ValueError, match=RANK):
        lm_head_logprobs(_linear(w), h, y, temperature=TEMPERATURE, select_rows=select_rows)


def test_causal_lm_logprobs_refuses_a_temperature_of_fewer_dimensions():
    ids = torch.randint(0, V, (B, S))
    with pytest.raises(
        ValueError, match=r"must broadcast to input_ids' shape \(3, 3\) with as many"
    ):
        causal_lm_logprobs(_TinyLM(), ids, temperature=TEMPERATURE)


def test_the_reference_refuses_a_temperature_of_fewer_dimensions():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match=RANK):
        fusedhead.reference_fused_head(h, w, y, temperature=TEMPERATURE)


@pytest.mark.parametrize(
    "temperature",
    [TEMPERATURE.reshape(B, 1), TEMPERATURE.reshape(1, S), torch.tensor(2.0), torch.tensor([2.0])],
    ids=["per-sequence", "per-position", "0-d", "one-element"],
)
@pytest.mark.parametrize("select_rows", [True, False])
def test_lm_head_logprobs_with_a_temperature_that_broadcasts_matches_the_reference(
    temperature, select_rows
):
    h, w, y = _inputs()
    out = lm_head_logprobs(_linear(w), h, y, temperature=temperature, select_rows=select_rows)
    lp, ent = fusedhead.reference_fused_head(
        h.double(), w.double(), y, temperature=temperature.double()
    )
    torch.testing.assert_close(out.log_probs.double(), lp, rtol=1e-5, atol=1e-5)
    assert out.entropy is not None
    torch.testing.assert_close(out.entropy.double(), ent, rtol=1e-5, atol=1e-5)


# A key given twice in a config file or a JSON object of options: YAML and JSON readers keep the
# last one without a word, so `backend: torch` then `backend: triton` ran triton. Refused, naming
# the key (and, in YAML, both lines).

DUPLICATE_YAML = [
    ("backend: torch\nbackend: triton\n", "backend", "line 1, again at line 2"),
    (
        "fused_head:\n  temperature: 1.0\n  temperature: 2.0\n",
        "temperature",
        "line 2, again at line 3",
    ),
    ("options: {chunk_rows: 2, chunk_rows: 3}\n", "chunk_rows", "line 1, again at line 1"),
]


@pytest.mark.parametrize(
    ("text", "key", "lines"), DUPLICATE_YAML, ids=["top", "section", "options"]
)
def test_a_yaml_config_that_repeats_a_key_is_refused_naming_it(tmp_path, text, key, lines):
    pytest.importorskip("yaml")
    with pytest.raises(ValueError, match=rf"found the key '{key}' twice \(first at {lines}\)"):
        fusedhead.FusedHeadConfig.from_yaml(text)
    path = tmp_path / "head.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{path}: not valid YAML .*'{key}' twice"):
        fusedhead.FusedHeadConfig.from_yaml(path)


def test_a_yaml_merge_key_may_still_be_overridden():
    pytest.importorskip("yaml")
    text = "fused_head:\n  <<: {temperature: 1.0, softcap: 3.0}\n  temperature: 2.0\n"
    cfg = fusedhead.FusedHeadConfig.from_yaml(text)
    assert (cfg.temperature, cfg.softcap) == (2.0, 3.0)


def test_a_yaml_file_that_is_not_utf8_is_a_value_error_naming_the_file(tmp_path):
    """Before: a bare UnicodeDecodeError that named no file."""
    pytest.importorskip("yaml")
    path = tmp_path / "head.yaml"
    path.write_bytes(b"backend: \xff\n")
    with pytest.raises(ValueError, match=rf"^{path}: not a YAML text file \(not UTF-8: byte 0xff"):
        fusedhead.FusedHeadConfig.from_yaml(path)


DUPLICATE_JSON = '{"chunk_rows": 2, "chunk_rows": 3}'


@pytest.mark.parametrize("command", ["check", "demo"])
def test_cli_options_that_repeat_a_key_are_refused_naming_it(capsys, command):
    rc = cli.main(
        [command, "torch", "--options", DUPLICATE_JSON]
        if command == "check"
        else [command, "--options", DUPLICATE_JSON]
    )
    err = capsys.readouterr().err
    assert rc != 0
    assert "argument --options: the key 'chunk_rows' is given twice" in err
    assert "Traceback" not in err


def test_bench_impl_options_that_repeat_a_key_are_refused_naming_it():
    with pytest.raises(ValueError, match=r"--impl .*\(the key 'chunk_rows' is given twice"):
        parse_spec(f"torch:{DUPLICATE_JSON}")


def test_kit_options_that_repeat_a_key_are_refused_naming_it():
    with pytest.raises(ValueError, match=r"the key 'chunk_rows' is given twice"):
        parse_options(DUPLICATE_JSON)
