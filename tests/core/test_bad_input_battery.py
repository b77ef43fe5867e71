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
- ``lm_head_logprobs`` named the rows it selected and the shape it flattened instead of the
  caller's; a ``logit_scale`` that fp32 cannot hold (NaN rows, or the uniform distribution) and an
  ``on_weight`` that is no callable (torch's "'int' object is not callable") were taken.
- ``causal_lm_logprobs``: a token id outside the model's embedding (torch's IndexError "index out
  of range in self"), float ids (torch's RuntimeError from the embedding), a truthy str for
  ``pack``, and a bad per-token temperature named at its packed row instead of the caller's.
- ``fusedhead.shards``: bounds the slots cannot carry came back as other numbers; a float, a
  rank past the world and a layout of the wrong size raised torch's or Python's own errors.
- A bad device string given to ``FusedHead.capabilities``, ``check_head_runs_on`` or
  ``diagnostics.listing(probe=True)`` raised torch's RuntimeError, or marked every plugin BROKEN.
- ``reference_fused_head``: a temperature tensor that does not broadcast, and a weight or labels
  on another device than hidden, raised torch's own RuntimeError.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fusedhead
from fusedhead import cli, diagnostics, shards
from fusedhead.bench.peers import parse_spec
from fusedhead.integrations.lm_head import (
    check_head_runs_on,
    lm_head_logprobs,
    lm_head_policy_loss,
)
from fusedhead.integrations.transformers import causal_lm_logprobs, shifted_labels
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


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)

    def forward(self, input_ids: torch.Tensor, **_: object) -> tuple[torch.Tensor]:
        return (self.embed(input_ids),)


class _TinyLM(nn.Module):
    """A causal LM as causal_lm_logprobs reads one: .model (the decoder), .lm_head and
    get_input_embeddings(); the hidden state of a position is its token's embedding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _Decoder()
        self.lm_head = nn.Linear(H, V, bias=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed


TEMPERATURE = torch.tensor([0.5, 1.0, 2.0])


@pytest.mark.parametrize("select_rows", [True, False])
def test_lm_head_logprobs_refuses_a_temperature_of_fewer_dimensions(select_rows):
    """Before: log-probs off by up to 8.6 (the temperatures of [B] laid along S)."""
    h, w, y = _inputs()
    with pytest.raises(ValueError, match=RANK):
        lm_head_logprobs(_linear(w), h, y, temperature=TEMPERATURE, select_rows=select_rows)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bool])
@pytest.mark.parametrize("call", ["lm_head_logprobs", "lm_head_policy_loss"])
def test_lm_head_calls_name_a_compute_dtype_no_head_computes_in(call, dtype):
    """Before: the cast went ahead and the error blamed hidden or the bias, which the caller never
    passed in that dtype."""
    h, w, y = _inputs()
    loss = {"old_log_probs": torch.zeros(B, S), "advantages": torch.ones(B, S)}
    run = (
        (lambda: lm_head_logprobs(_linear(w), h, y, compute_dtype=dtype))
        if call == "lm_head_logprobs"
        else (lambda: lm_head_policy_loss(_linear(w), h, y, compute_dtype=dtype, **loss))
    )
    with pytest.raises(
        TypeError,
        match=rf"compute_dtype must be torch.float32, torch.float16 or torch.bfloat16 .*{dtype}",
    ):
        run()


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


# lm_head_logprobs sends the scored rows only (select_rows=True, the default) and flattens hidden:
# its refusals named the selected rows ("flat position 3" for the caller's position 5) and the
# flattened shape ("hidden shape (4, 8)" for the caller's (2, 3, 8)). They name what the caller
# passed, with rows selected or not.


def _ragged() -> tuple[torch.Tensor, torch.Tensor]:
    h, _, y = _inputs()
    y = y.clone()
    y[0, :2] = -100  # two ignored rows before the faulty position (1, 2), flat position 8
    return h, y


FAULTS = {
    "labels": (
        lambda y: {"labels": torch.where(torch.arange(B * S).reshape(B, S) == 8, V + 3, y)},
        r"got 14 at flat position 8",
    ),
    "temperature": (
        lambda y: {"temperature": torch.where(torch.arange(B * S).reshape(B, S) == 8, 0.0, 1.0)},
        r"got 0\.0 \(as fp32\) at flat position 8",
    ),
    "gather_ids": (
        lambda y: {
            "gather_ids": torch.where(
                torch.arange(B * S).reshape(B, S) == 8, V + 1, y.clamp(min=0)
            )[..., None]
        },
        r"got 12 at flat row 8, position 0",
    ),
}


@pytest.mark.parametrize("select_rows", [True, False])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_lm_head_logprobs_names_the_callers_position_of_a_bad_value(select_rows, fault):
    h, y = _ragged()
    make, words = FAULTS[fault]
    kw = make(y)
    labels = kw.pop("labels", y)
    with pytest.raises(ValueError, match=words):
        lm_head_logprobs(_linear(torch.randn(V, H)), h, labels, select_rows=select_rows, **kw)


def test_lm_head_logprobs_of_a_head_that_checks_nothing_reads_no_value():
    h, y = _ragged()
    y[1, 2] = V + 3
    out = lm_head_logprobs(
        _linear(torch.randn(V, H)), h, y, head={"backend": "torch", "check_labels": False}
    )
    assert out.log_probs.shape == (B, S)


@pytest.mark.parametrize("select_rows", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_lm_head_logprobs_names_the_callers_hidden_shape_when_h_differs(select_rows, bias):
    h, y = _ragged()
    with pytest.raises(
        ValueError, match=rf"lm_head's weight H=4 .* got hidden shape \({B}, {S}, {H}\)"
    ):
        lm_head_logprobs(nn.Linear(4, V, bias=bias), h, y, select_rows=select_rows)


@pytest.mark.parametrize(
    "scale", [1e39, 2.0**127, 1e-46, 5e-324, -1e39, math.nan, math.inf, 10**400, 0]
)
def test_lm_head_logprobs_refuses_a_logit_scale_fp32_cannot_hold(scale):
    """Before: 1e39 gave NaN in every row, 1e-46 the uniform distribution, without an error."""
    h, w, y = _inputs()
    with pytest.raises(
        ValueError, match=r"logit_scale must be a finite non-zero float whose magnitude"
    ):
        lm_head_logprobs(_linear(w), h, y, logit_scale=scale)


@pytest.mark.parametrize("scale", [2.0**-126, 0.5, -1.0, 30.0])
def test_lm_head_logprobs_takes_a_logit_scale_fp32_holds(scale):
    h, w, y = _inputs()
    out = lm_head_logprobs(_linear(w), h, y, logit_scale=scale)
    lp, _ = fusedhead.reference_fused_head(h.double() * scale, w.double(), y)
    torch.testing.assert_close(out.log_probs.double(), lp, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("value", [3, "hook", torch.zeros(1)], ids=["int", "str", "tensor"])
def test_lm_head_logprobs_refuses_an_on_weight_that_is_no_callable(value):
    """Before: TypeError "'int' object is not callable" from inside the head call."""
    h, w, y = _inputs()
    with pytest.raises(
        TypeError, match=r"on_weight must be a callable taking \(weight, bias\) or None"
    ):
        lm_head_logprobs(_linear(w), h, y, on_weight=value)


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0  # left padding: packed rows differ from the caller's positions
    return ids, mask


@pytest.mark.parametrize(("value", "shown"), [(V + 5, V + 5), (-1, -1)], ids=["above", "negative"])
@pytest.mark.parametrize("pack", [True, False])
def test_causal_lm_logprobs_refuses_a_token_id_outside_the_embedding(value, shown, pack):
    """Before: IndexError 'index out of range in self' from inside the model."""
    ids, mask = _ids()
    ids[1, 4] = value
    with pytest.raises(
        ValueError,
        match=rf"input_ids must be token ids in \[0, {V}\) .* got {shown} at position \(1, 4\)",
    ):
        causal_lm_logprobs(_TinyLM(), ids, mask, pack=pack)


@pytest.mark.parametrize(
    ("ids", "error", "words"),
    [
        (
            torch.zeros(2, 6),
            TypeError,
            r"input_ids must be int64 or int32 token ids .*got dtype torch.float32: pass "
            r"input_ids.long\(\)",
        ),
        # Before: torch's "Expected tensor for argument #1 'indices' ..." from inside the model.
        *(
            (
                torch.zeros(2, 6, dtype=dtype),
                TypeError,
                rf"input_ids must be int64 or int32 token ids .*got dtype {dtype}",
            )
            for dtype in (torch.int16, torch.int8, torch.uint8)
        ),
        ([[1, 2, 3]], TypeError, r"input_ids must be a torch.Tensor, got list"),
    ],
    ids=["float", "int16", "int8", "uint8", "list"],
)
def test_causal_lm_logprobs_names_input_ids_of_a_wrong_type(ids, error, words):
    with pytest.raises(error, match=words):
        causal_lm_logprobs(_TinyLM(), ids)


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32]
)
def test_shifted_labels_are_int64_so_ignore_index_never_wraps_into_a_token(dtype):
    """Before: uint8 ids gave labels of 156 (-100 wrapped) at padding, scored as that token."""
    ids = torch.tensor([[0, 7, 3, 9], [4, 5, 6, 8]]).to(dtype)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    labels = shifted_labels(ids, mask)
    assert labels.dtype == torch.int64
    assert labels.tolist() == [[-100, 3, 9, -100], [5, 6, -100, -100]]
    wide = shifted_labels(ids, ignore_index=-100_000)  # beyond int16: was torch's overflow error
    assert wide[:, -1].tolist() == [-100_000, -100_000]


@pytest.mark.parametrize(
    ("ids", "kwargs", "error", "words"),
    [
        (torch.zeros(2, 6), {}, TypeError, r"input_ids must be an integer tensor .*float32"),
        (torch.zeros(2, 6, dtype=torch.bool), {}, TypeError, r"input_ids must be an integer"),
        (torch.zeros(2, 6, dtype=torch.long), {"ignore_index": 1.5}, TypeError, r"ignore_index"),
        (
            torch.zeros(2, 6, dtype=torch.long),
            {"ignore_index": 2**70},
            ValueError,
            r"ignore_index must fit in int64, got 1180591620717411303424",
        ),
    ],
    ids=["float", "bool", "float-ignore-index", "huge-ignore-index"],
)
def test_shifted_labels_names_what_it_cannot_shift(ids, kwargs, error, words):
    """Before: float ids came back as float labels; a huge ignore_index raised torch's overflow."""
    with pytest.raises(error, match=words):
        shifted_labels(ids, **kwargs)


@pytest.mark.parametrize("pack", ["yes", 1, None])
def test_causal_lm_logprobs_pack_must_be_a_bool(pack):
    ids, mask = _ids()
    with pytest.raises(TypeError, match=r"pack must be a bool, got"):
        causal_lm_logprobs(_TinyLM(), ids, mask, pack=pack)


@pytest.mark.parametrize("pack", [True, False])
def test_causal_lm_logprobs_names_the_callers_position_of_a_bad_temperature(pack):
    ids, mask = _ids()
    temp = torch.ones(2, 6)
    temp[1, 3] = 0.0  # flat position 9; row 6 among the packed rows
    with pytest.raises(ValueError, match=r"got 0\.0 \(as fp32\) at flat position 9"):
        causal_lm_logprobs(_TinyLM(), ids, mask, temperature=temp, pack=pack)


@pytest.mark.parametrize("pack", [True, False])
def test_causal_lm_logprobs_of_good_ids_matches_the_reference(pack):
    ids, mask = _ids()
    model = _TinyLM()
    out = causal_lm_logprobs(model, ids, mask, pack=pack)
    labels = shifted_labels(ids, mask)
    lp, ent = fusedhead.reference_fused_head(
        model.model.embed.weight[ids].double(), model.lm_head.weight.double(), labels
    )
    torch.testing.assert_close(out.log_probs.double(), lp, rtol=1e-5, atol=1e-5)
    assert out.entropy is not None
    torch.testing.assert_close(out.entropy.double(), ent, rtol=1e-5, atol=1e-5)


# fusedhead.shards (public for backend authors): a bound the slots cannot carry came back as
# another number (shard_slots(-1, ...) as 2**63 - 1, 2**80 as 0) without a word; a float, a
# rank past the world or a layout of the wrong size raised torch's or Python's own error.


@pytest.mark.parametrize(
    ("args", "error", "words"),
    [
        ((-1, 4, 10), ValueError, r"start must be an int in \[0, 2\*\*63\), got -1"),
        ((0, 2**80, 10), ValueError, r"width must be an int in \[0, 2\*\*63\), got 1208925"),
        ((0, 4, 2**63), ValueError, r"size must be an int in \[0, 2\*\*63\)"),
        ((1.5, 4, 10), TypeError, r"start must be an int, got float 1.5"),
        ((0, True, 10), TypeError, r"width must be an int, got bool True"),
    ],
    ids=["negative", "too-wide", "int64-overflow", "float", "bool"],
)
def test_shard_slots_refuses_a_bound_it_cannot_carry(args, error, words):
    with pytest.raises(error, match=words):
        shards.shard_slots(*args)


@pytest.mark.parametrize(("start", "width", "size"), [(0, 4, 10), (2**62, 2**21, 2**63 - 1)])
def test_shard_slots_round_trip_the_bounds_they_carry(start, width, size):
    layout = torch.tensor([shards.shard_slots(start, width, size)], dtype=torch.float32)
    assert shards.gathered_shards(layout) == [(start, width, size)]


@pytest.mark.parametrize(
    ("world", "rank", "words"),
    [
        (2, 5, r"rank must be in \[0, world=2\), got 5"),
        (0, 0, r"world must be an int >= 1, got 0"),
        (2, -1, r"rank must be an int >= 0, got -1"),
    ],
    ids=["rank-past-world", "no-world", "negative-rank"],
)
def test_shard_slots_tensor_refuses_a_rank_outside_the_world(world, rank, words):
    """Before: IndexError 'index 5 is out of bounds for dimension 0 with size 2'."""
    with pytest.raises(ValueError, match=words):
        shards.shard_slots_tensor(0, 4, 8, torch.device("cpu"), world=world, rank=rank)


@pytest.mark.parametrize(
    ("layout", "error", "words"),
    [
        (torch.zeros(5), ValueError, r"layout must hold 9 floats per rank .* got shape \(5,\)"),
        (torch.zeros(3, 5), ValueError, r"got shape \(3, 5\)"),
        (torch.zeros(0, 9), ValueError, r"got shape \(0, 9\)"),
        ([0.0] * 9, TypeError, r"layout must be a torch.Tensor \[world, 9\], got list"),
    ],
    ids=["short", "wrong-width", "empty", "list"],
)
def test_a_gathered_layout_of_the_wrong_size_is_named(layout, error, words):
    """Before: torch's "shape '[-1, 9]' is invalid for input of size 5" or AttributeError."""
    with pytest.raises(error, match=words):
        shards.gathered_shards(layout)
    with pytest.raises(error, match=words):
        shards.check_shards(layout, 0, None, 0, 4, 8)


def test_shards_need_check_takes_a_device_string():
    assert shards.shards_need_check(None, 0, 4, 8, "cpu") is True


# A device the caller names wrongly (a typo, an int): FusedHead.capabilities and
# check_head_runs_on raised torch's RuntimeError ("Expected one of cpu, cuda, ... at start of
# device string: tpu"; an int: "Cannot access accelerator device"), and diagnostics.listing
# (probe=True) marked every installed plugin BROKEN with that error: the caller's mistake blamed
# on the plugins. Each names the argument now.

BAD_DEVICES = [
    (
        "tpu",
        ValueError,
        r"device must be a torch device string such as 'cpu', 'cuda' or 'cuda:1', got 'tpu'",
    ),
    ("cuda:x", ValueError, r"got 'cuda:x'"),
    (3, TypeError, r"device must be a torch.device or a device string .* got int 3"),
]


@pytest.mark.parametrize(
    ("device", "error", "words"), BAD_DEVICES, ids=["unknown", "bad-index", "int"]
)
def test_capabilities_names_a_bad_device(device, error, words):
    head = fusedhead.FusedHead({"backend": "torch"})
    with pytest.raises(error, match=words):
        head.capabilities(device)


@pytest.mark.parametrize(
    ("device", "error", "words"), BAD_DEVICES, ids=["unknown", "bad-index", "int"]
)
def test_check_head_runs_on_names_a_bad_device(device, error, words):
    head = fusedhead.FusedHead({"backend": "torch"})
    with pytest.raises(error, match=words):
        check_head_runs_on(head, device, setting="fused_head")


@pytest.mark.parametrize(
    ("device", "error", "words"), BAD_DEVICES, ids=["unknown", "bad-index", "int"]
)
def test_a_probe_on_a_bad_device_blames_the_device_not_the_plugins(device, error, words):
    with pytest.raises(error, match=words):
        diagnostics.listing(probe=True, device=device)


def test_capabilities_take_a_device_string_or_a_device():
    head = fusedhead.FusedHead({"backend": "torch"})
    assert head.capabilities("cpu") == head.capabilities(torch.device("cpu"))


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (
            {"temperature": torch.ones(B, S + 1)},
            r"temperature tensor of shape \(3, 4\) must broadcast to the labels' shape \(3, 3\)",
        ),
        ({"labels": "meta"}, r"labels must be on hidden's device cpu, got meta"),
        ({"weight": "meta"}, r"weight must be on hidden's device cpu, got meta"),
    ],
    ids=["temperature-shape", "labels-device", "weight-device"],
)
def test_the_reference_names_a_temperature_or_device_it_cannot_use(kw, words):
    """Before: torch's expand RuntimeError, or 'Tensor on device cpu is not on the expected
    device meta!'."""
    h, w, y = _inputs()
    args = {"weight": w, "labels": y, "temperature": 1.0}
    for k, v in kw.items():
        args[k] = args[k].to("meta") if v == "meta" else v
    with pytest.raises(ValueError, match=words):
        fusedhead.reference_fused_head(
            h, args["weight"], args["labels"], temperature=args["temperature"]
        )


def test_a_verified_shard_layout_is_remembered_by_its_group_not_the_groups_id():
    """On CUDA a (group, shard) checked once is not read again. Keyed by ``id(group)``, a group
    destroyed and replaced by another at the same address passed unchecked (CPython reuses the
    address of a freed object at once); the group itself is the key now."""

    class Group:
        pass

    group = Group()
    shards._VERIFIED_SHARDS.add((group, 0, 4, 8))  # what check_shards records on CUDA
    assert not shards.shards_need_check(group, 0, 4, 8, "cuda")
    del group
    assert all(shards.shards_need_check(Group(), 0, 4, 8, "cuda") for _ in range(200))
