"""Arguments beyond the tensors, as a trainer would get them wrong: each refusal is a
ValueError/TypeError naming the argument, the value and what it takes, raised before a backend
(or torch.distributed) sees the value.
"""

from __future__ import annotations

import pytest

from fusedhead import FusedHeadConfig, fused_head, fused_kl


def head(h, w, y, **kw):
    return fused_head(h, w, y, backend="ref-test", **kw)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"vocab_start": 0.0}, ["vocab_start must be an int or None", "float 0.0"]),
        ({"vocab_size": "11"}, ["vocab_size must be an int or None", "str '11'"]),
        ({"vocab_start": False}, ["vocab_start must be an int or None", "bool False"]),
        ({"vocab_size": 11.0}, ["vocab_size must be an int or None", "float 11.0"]),
    ],
)
def test_vocab_bounds_have_their_type_checked_without_a_process_group(
    ref_backend, inputs, kwargs, words
):
    with pytest.raises(TypeError) as info:
        head(*inputs(), **kwargs)
    for word in words:
        assert word in str(info.value)
    head(*inputs(), vocab_start=0, vocab_size=11)  # the whole vocabulary, said out loud: fine


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_process_group_must_be_a_process_group(ref_backend, inputs, world_of_one):
    for group in (object(), "world", 0):
        with pytest.raises(TypeError) as info:
            head(*inputs(), process_group=group)
        text = str(info.value)
        assert "process_group must be a torch.distributed.ProcessGroup" in text
        assert type(group).__name__ in text
        assert "NON_GROUP_MEMBER" not in text
    assert not ref_backend.calls


def test_a_rank_outside_its_new_group_is_told_so(ref_backend, inputs, world_of_one):
    """dist.new_group hands ranks outside the group an int marker, which said only 'got int'."""
    import torch.distributed as dist

    with pytest.raises(TypeError, match=r"GroupMember\.NON_GROUP_MEMBER on a rank outside"):
        head(*inputs(), process_group=dist.GroupMember.NON_GROUP_MEMBER)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"vocab_size": 2**70}, ["vocab_size must fit in int64", str(2**70)]),
        ({"vocab_start": 2**70, "vocab_size": 2**71}, ["vocab_size must fit in int64"]),
        ({"vocab_start": 1.0}, ["vocab_start must be an int or None", "float 1.0"]),
    ],
)
def test_vocab_bounds_under_a_process_group(ref_backend, inputs, world_of_one, kwargs, words):
    """Before: an OverflowError from comparing the labels with a 70-bit vocab_size."""
    with pytest.raises((ValueError, TypeError)) as info:
        head(*inputs(), process_group=world_of_one, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_kl_names_the_teacher_pair_whose_dtypes_differ(ref_backend, inputs):
    h, w, y = inputs()
    th, tw = inputs(h=5, seed=1)[:2]
    with pytest.raises(TypeError) as info:
        fused_kl(h, w, th, tw.half(), y, backend="ref-test")
    text = str(info.value)
    assert text.startswith("teacher_hidden and teacher_weight must share a dtype"), text
    assert "teacher_weight torch.float16" in text


@pytest.mark.parametrize(
    ("data", "error", "words"),
    [
        ({"options": {1: 2}}, TypeError, ["field 'options' has the key 1 (int)"]),
        ({"require": ["deterministic", 3]}, TypeError, ["field 'require'[1] = 3 (int)"]),
        ({"ignore_index": 2**70}, ValueError, ["field 'ignore_index'", "must fit in int64"]),
    ],
)
def test_config_names_the_key_or_item_at_fault(data, error, words):
    with pytest.raises(error) as info:
        FusedHeadConfig(**data)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("value", ["no", 0, 1, "False"])
def test_kl_check_labels_must_be_a_bool(ref_backend, inputs, value):
    """Before: the KL took any object as check_labels and used its truth value, so ``0`` or
    ``"False"`` skipped or kept the temperature checks silently (a head call refuses it)."""
    from fusedhead import FusedHead

    h, w, y = inputs()
    th, tw = inputs(h=5, seed=1)[:2]
    for call in (
        lambda: fused_kl(h, w, th, tw, y, backend="ref-test", check_labels=value),
        lambda: FusedHead(backend="ref-test").kl(h, w, th, tw, y, check_labels=value),
    ):
        with pytest.raises(TypeError) as info:
            call()
        assert (
            str(info.value) == f"check_labels must be a bool, got {type(value).__name__} {value!r}"
        )


@pytest.mark.parametrize(
    ("text", "want"), [("1e-3", 1e-3), ("1.e-3", 1e-3), ("2E+1", 20.0), ("-1.5e2", None)]
)
def test_yaml_reads_an_exponent_float_as_a_float(ref_backend, text, want):
    """PyYAML's YAML 1.1 rules read '1e-3' as a str: 'temperature: 1e-3' was refused as
    "'1e-3' (str): expected float"; YAML 1.2 and OmegaConf (Hydra) read the float."""
    pytest.importorskip("yaml")
    if want is None:  # a float, so the range check (not the type check) refuses it
        with pytest.raises(ValueError, match=r"field 'temperature' = -150\.0 \(float\)"):
            FusedHeadConfig.from_yaml(f"temperature: {text}")
        return
    assert FusedHeadConfig.from_yaml(f"temperature: {text}").temperature == want
    assert FusedHeadConfig.from_yaml(f"softcap: {text}").softcap == want


def test_yaml_keeps_ints_and_quoted_strs(ref_backend):
    pytest.importorskip("yaml")
    config = FusedHeadConfig.from_yaml("ignore_index: 10\ntemperature: 2\n")
    assert config.ignore_index == 10 and type(config.ignore_index) is int
    with pytest.raises(TypeError, match=r"field 'temperature' = '1e-3' \(str\)"):
        FusedHeadConfig.from_yaml("temperature: '1e-3'")


def test_yaml_given_a_file_name_as_text_says_to_pass_a_path(tmp_path):
    pytest.importorskip("yaml")
    with pytest.raises(TypeError) as info:
        FusedHeadConfig.from_yaml("configs/head.yaml")
    text = str(info.value)
    assert "got a YAML str" in text and "pathlib.Path('configs/head.yaml')" in text
    with pytest.raises(TypeError) as info:
        FusedHeadConfig.from_yaml("just words")
    assert "pathlib" not in str(info.value)


@pytest.mark.parametrize("name", ["Ref-Test", " ref-test", "", "ref-test\n"])
@pytest.mark.parametrize("how", ["fused_head", "fused_kl", "FusedHead", "get_fused_head"])
def test_an_invalid_backend_name_names_the_argument_not_a_config_never_built(
    ref_backend, inputs, how, name
):
    """Before: 'FusedHeadConfig: backend name ...' from a call that built no FusedHeadConfig."""
    from fusedhead import FusedHead
    from fusedhead.api import get_fused_head

    h, w, y = inputs()
    select = {
        "fused_head": lambda: fused_head(h, w, y, backend=name),
        "fused_kl": lambda: fused_kl(h, w, h, w, y, backend=name),
        "FusedHead": lambda: FusedHead(backend=name),
        "get_fused_head": lambda: get_fused_head(name),
    }[how]
    with pytest.raises(ValueError) as info:
        select()
    assert str(info.value).startswith(
        f"backend name {name!r} is not valid: expected lowercase [a-z0-9_-]+"
    )


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("fusedhead:triton", "names fusedhead's backend 'triton': pass 'triton'"),
        ("Torch", "did you mean 'torch'?"),
    ],
)
def test_an_invalid_backend_name_says_what_was_meant(name, hint):
    """The trainers' ``fusedhead:NAME`` spelling and an upper-case name point at the name."""
    from fusedhead import FusedHead

    with pytest.raises(ValueError, match="is not valid") as info:
        FusedHead(backend=name)
    assert hint in str(info.value)


def test_a_backend_registered_under_a_name_with_a_final_newline_is_refused():
    """The name check is of the whole name: a trailing newline used to slip past ``$``."""
    from fusedhead import register_backend
    from fusedhead.registry import candidates

    with pytest.raises(ValueError, match="is not valid") as info:
        register_backend("mine\n", object)
    assert "'mine\\n'" in str(info.value)
    assert "mine\n" not in candidates()


def test_a_bad_keyword_of_fused_head_names_the_argument(ref_backend):
    from fusedhead import FusedHead

    with pytest.raises(ValueError) as info:
        FusedHead(backend="ref-test", temprature=0.5)
    text = str(info.value)
    assert text.startswith("unknown argument 'temprature' = 0.5 (float) (did you mean "), text
    assert "FusedHeadConfig" not in text and "Arguments: backend, options, " in text


def test_a_config_built_by_the_caller_keeps_its_own_name(ref_backend):
    with pytest.raises(ValueError, match=r"^FusedHeadConfig: backend name 'Ref-Test' is not"):
        FusedHeadConfig(backend="Ref-Test")
    with pytest.raises(ValueError, match=r"^FusedHeadConfig: unknown field 'temprature'"):
        FusedHeadConfig(backend="ref-test", temprature=0.5)


def _cyclic() -> dict:
    d: dict = {"a": 1}
    d["self"] = d
    return d


@pytest.mark.parametrize(
    "mapping",
    [{1: 2, "a": 3}, {(1,): 2}, {"a": {1: 2, "b": 3}}, {"a": [{2: 1, "x": 0}]}, {1: 2}, _cyclic()],
    ids=["int-beside-str", "tuple", "nested-mixed", "in-a-list", "int-alone", "cycle"],
)
def test_the_cache_key_of_options_never_raises_so_validation_names_the_key(mapping):
    """Before: the cache key was sorted JSON, so ``{1: 2, "a": 3}`` raised Python's bare "'<' not
    supported between instances of 'str' and 'int'" (and ``{(1,): 2}`` "keys must be str") before
    validation could name the key. Now the key always forms, the same for the same mapping."""
    from fusedhead.options import cache_text

    text = cache_text(mapping)
    assert isinstance(text, str) and text == cache_text(mapping)


def test_the_cache_key_of_options_is_sorted_json_and_tells_an_int_key_from_a_str_one():
    """Keys of str-keyed options are unchanged; JSON writes 1 and "1" alike, the key does not."""
    import json

    from fusedhead.options import cache_text

    options = {"b": {"y": 1, "x": [2, 3]}, "a": None, "c": 1.5}
    assert cache_text(options) == json.dumps(options, sort_keys=True)
    assert cache_text({1: 2}) != cache_text({"1": 2})
    assert cache_text({"a": {1: 2}}) != cache_text({"a": {"1": 2}})


@pytest.mark.parametrize(
    ("options", "key"), [({1: 2, "a": 3}, "1 (int)"), ({(1,): 2}, "(1,) (tuple)")]
)
def test_an_options_key_that_is_not_a_str_is_named_by_every_entry_point(
    ref_backend, inputs, options, key
):
    """Before: building the cache key sorted the keys first, so ``{1: 2, "a": 3}`` raised
    Python's bare "'<' not supported between instances of 'str' and 'int'" (and ``{(1,): 2}``
    "keys must be str, ...") from fused_head, fused_kl, fused_policy_loss and cached_head, where
    ``{1: 2}`` alone got the error naming the key. Now every one names the key."""
    import torch

    from fusedhead import fused_policy_loss
    from fusedhead.api import cached_head

    h, w, y = inputs()
    th, tw = inputs(h=5, seed=1)[:2]
    zeros = torch.zeros(y.shape)
    argument = f"argument 'options' has the key {key}: expected dict[str, Any]"
    calls = {
        argument: [
            lambda: fused_head(h, w, y, backend="ref-test", options=options),
            lambda: fused_kl(h, w, th, tw, y, backend="ref-test", options=options),
            lambda: fused_policy_loss(
                h, w, y, old_log_probs=zeros, advantages=zeros, backend="ref-test",
                options=options,
            ),
        ],
        f"field 'options' has the key {key}": [
            lambda: cached_head({"backend": "ref-test", "options": options}),
        ],
    }  # fmt: skip
    for words, entry_points in calls.items():
        for call in entry_points:
            with pytest.raises(TypeError) as info:
                call()
            assert words in str(info.value), str(info.value)
    with pytest.raises(TypeError, match="config keys must be field names"):
        cached_head({1: 2, "backend": "ref-test"})
    assert not ref_backend.calls


@pytest.mark.parametrize(
    ("call", "keyword", "said"),
    [
        ("fused_head", "temperatur", "(did you mean 'temperature'?)"),
        ("fused_head", "calculate_entropy", "(verl's name of return_entropy)"),
        ("fused_head", "compute_entropy", "(TRL's name of return_entropy)"),
        ("FusedHead.__call__", "ignore_idx", "(did you mean 'ignore_index'?)"),
        ("fused_kl", "directon", "(did you mean 'direction'?)"),
        ("FusedHead.kl", "teacher_temp", "(did you mean 'teacher_temperature'?)"),
    ],
)
def test_an_unknown_keyword_of_a_head_call_says_what_was_meant(
    ref_backend, inputs, call, keyword, said
):
    """Python's own TypeError names the keyword only; these name the parameter it stands for
    (a typo's closest name, or the trainer's name it is) and list the call's keywords."""
    from fusedhead import FusedHead

    h, w, y = inputs()
    calls = {
        "fused_head": lambda **kw: fused_head(h, w, y, backend="ref-test", **kw),
        "FusedHead.__call__": lambda **kw: FusedHead(backend="ref-test")(h, w, y, **kw),
        "fused_kl": lambda **kw: fused_kl(h, w, h, w, y, backend="ref-test", **kw),
        "FusedHead.kl": lambda **kw: FusedHead(backend="ref-test").kl(h, w, h, w, y, **kw),
    }
    with pytest.raises(TypeError) as info:
        calls[call](**{keyword: 1})
    text = str(info.value)
    assert text.startswith(f"{call}() got unexpected keyword argument: '{keyword}' {said}"), text
    assert "Its keyword arguments: " in text and "temperature" in text
