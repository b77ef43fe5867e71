"""FusedHeadConfig and backend options are strict and say what is wrong in one line.

Malformed YAML names the file and the line; YAML numbers are read by YAML 1.2's rules (``010`` is
10, ``1:30`` a string), never misread silently; a bool or a string is never a number; the YAML shape
docs/configuration.md shows loads; a bad device names ``device``; a bad option names the option,
the value, what it takes and every valid option of the backend (no pydantic dump, no links).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

import pytest
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from fusedhead import FusedHeadConfig
from fusedhead.config import OptionsError, describe_type, option_signatures, validate_options
from fusedhead.errors import BackendError

ROOT = Path(__file__).resolve().parents[2]


class StrictOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tile: PositiveInt | None = None
    scale: float = Field(1.0, gt=0)
    exact: bool = False
    mode: Literal["fast", "safe"] = "fast"
    shape: tuple[int, ...] = (1, 2)


@pytest.fixture
def strict_backend(variant: Any) -> type:
    """The core's reference test backend under another name, with options of every kind."""
    return variant("strict-test", Options=StrictOptions)  # type: ignore[no-any-return]


def _no_pydantic_dump(message: str) -> None:
    assert "errors.pydantic.dev" not in message and "validation error" not in message
    assert "\n" not in message


# --- YAML -----------------------------------------------------------------------------------------


def test_malformed_yaml_names_the_file_line_and_column(tmp_path, ref_backend):
    path = tmp_path / "head.yaml"
    path.write_text("backend: ref-test\noptions: {tag: x\ntemperature: 0.7\n")
    with pytest.raises(ValueError) as info:
        FusedHeadConfig.from_yaml(path)
    msg = str(info.value)
    assert str(path) in msg and re.search(r"line \d+, column \d+", msg), msg
    assert type(info.value) is ValueError  # not the parser's own error class
    with pytest.raises(ValueError, match=r"<yaml text>: not valid YAML at line 2, column 14"):
        FusedHeadConfig.from_yaml("backend: ref-test\n  temperature: [\n")
    with pytest.raises(ValueError, match=r"cfg\.yaml: not valid YAML at line 1"):
        FusedHeadConfig.from_yaml("backend: [", source="cfg.yaml")


def test_a_backend_error_from_a_yaml_file_names_the_file(tmp_path, strict_backend):
    """A bad option or an unknown backend in a trainer's config file: the message and the
    error's reason field name the file, and the error keeps its class and backend fields."""
    path = tmp_path / "head.yaml"
    path.write_text("fused_head:\n  backend: strict-test\n  options:\n    mode: quick\n")
    with pytest.raises(OptionsError) as info:
        FusedHeadConfig.from_yaml(path)
    assert info.value.reason.startswith(f"{path}: option 'mode' = 'quick'"), info.value.reason
    assert info.value.backend == "strict-test" and str(path) in str(info.value)
    path.write_text("backend: strict-tst\n")
    with pytest.raises(BackendError) as unknown:
        FusedHeadConfig.from_yaml(path)
    assert str(unknown.value).startswith(f"{path}: unknown fusedhead backend 'strict-tst'")
    with pytest.raises(OptionsError) as text:  # YAML text has no file to name
        FusedHeadConfig.from_yaml("backend: strict-test\noptions: {mode: quick}\n")
    assert text.value.reason.startswith("option 'mode'"), text.value.reason


def test_yaml_that_is_not_a_mapping_is_refused_naming_the_source(ref_backend):
    with pytest.raises(TypeError, match=r"<yaml text>: .*mapping.*got a YAML list"):
        FusedHeadConfig.from_yaml("- backend: ref-test\n")


def test_the_yaml_shape_of_the_configuration_doc_loads(ref_backend):
    doc = (ROOT / "docs" / "configuration.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", doc, re.S)
    assert block is not None and block.group(1).startswith("fused_head:")
    cfg = FusedHeadConfig.from_yaml(block.group(1))  # the doc's own snippet, as written
    assert cfg.backend == "triton" and cfg.require == ["batch_invariant"]
    assert cfg.temperature == 0.7
    wrapped = FusedHeadConfig.from_yaml("fused_head:\n  backend: ref-test\n  temperature: 0.5\n")
    top = FusedHeadConfig.from_yaml("backend: ref-test\ntemperature: 0.5\n")
    assert wrapped == top and wrapped.temperature == 0.5


@pytest.mark.parametrize(
    ("text", "value"),
    [("010", 10), ("-010", -10), ("0o10", 8), ("0x1f", 31), ("1_024", 1024), ("+7", 7)],
)
def test_yaml_ints_are_read_by_yaml_1_2_rules(ref_backend, text, value):
    """Before: PyYAML's YAML 1.1 rules read '010' as octal 8, silently; YAML 1.2 reads 10."""
    config = FusedHeadConfig.from_yaml(f"backend: ref-test\nignore_index: {text}\n")
    assert config.ignore_index == value and type(config.ignore_index) is int


def test_a_backend_option_with_a_leading_zero_is_decimal():
    config = FusedHeadConfig.from_yaml("backend: torch\noptions:\n  chunk_rows: 010\n")
    assert config.options == {"chunk_rows": 10}


@pytest.mark.parametrize(
    ("text", "value"), [("1e-3", 1e-3), ("1.e-3", 1e-3), (".5", 0.5), ("5E-1", 0.5), ("2.", 2.0)]
)
def test_yaml_floats_are_read_by_yaml_1_2_rules(ref_backend, text, value):
    """YAML 1.1 read '1e-3' as a str, refused as one; YAML 1.2 reads the float."""
    assert (
        FusedHeadConfig.from_yaml(f"backend: ref-test\ntemperature: {text}\n").temperature == value
    )


@pytest.mark.parametrize(
    ("field", "text", "expected"),
    [
        ("temperature", "1:30", "float"),
        ("softcap", "1:30.5", "float or None"),
        ("ignore_index", "-1:40", "int"),
    ],
)
def test_a_base_60_number_is_a_str_the_config_refuses_naming_the_field(
    ref_backend, field, text, expected
):
    """Before: YAML 1.1's base 60 read 'temperature: 1:30' as 90.0, silently; YAML 1.2 reads the
    str, which the field refuses as it refuses any str."""
    with pytest.raises(TypeError) as info:
        FusedHeadConfig.from_yaml(f"backend: ref-test\n{field}: {text}\n")
    assert str(info.value) == (
        f"FusedHeadConfig: field '{field}' = '{text}' (str): expected {expected}"
    )


def test_an_explicit_int_tag_on_a_base_60_number_names_the_line(ref_backend):
    with pytest.raises(ValueError) as info:
        FusedHeadConfig.from_yaml("backend: ref-test\nignore_index: !!int 1:30\n")
    assert str(info.value) == (
        "<yaml text>: not valid YAML at line 2, column 15: expected an integer, got '1:30'"
    )


def test_fused_head_beside_other_keys_is_refused(ref_backend):
    with pytest.raises(ValueError, match=r"'fused_head' beside other keys \['model'\]"):
        FusedHeadConfig.from_yaml("model: x\nfused_head:\n  backend: ref-test\n")


# --- strict config fields -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,field",
    [
        ("temperature: yes", "temperature"),
        ("temperature: '0.7'", "temperature"),
        ("softcap: true", "softcap"),
        ("ignore_index: true", "ignore_index"),
        ("ignore_index: -100.0", "ignore_index"),
        ("return_entropy: 1", "return_entropy"),
        ("check_labels: 'no'", "check_labels"),
        ("backend: 3", "backend"),
    ],
)
def test_config_types_are_strict(ref_backend, text, field):
    with pytest.raises(TypeError) as info:
        FusedHeadConfig.from_yaml(text if field == "backend" else f"backend: ref-test\n{text}\n")
    msg = str(info.value)
    assert f"'{field}'" in msg and "expected" in msg, msg
    _no_pydantic_dump(msg)


def test_an_int_is_a_float_and_a_huge_one_is_refused_cleanly(ref_backend):
    assert FusedHeadConfig(backend="ref-test", temperature=2).temperature == 2.0
    with pytest.raises(ValueError, match=r"'temperature' = an int of 401 digits: must be a finite"):
        FusedHeadConfig(backend="ref-test", temperature=10**400)


@pytest.mark.parametrize("field", ["temperature", "softcap"])
@pytest.mark.parametrize("make", ["bool", "0-d", "1-d"])
def test_a_tensor_is_no_float_for_a_config(ref_backend, field, make):
    """Before: torch.tensor(True) was read as 1.0 and a one-element tensor as its value."""
    import torch

    value = {
        "bool": torch.tensor(True),
        "0-d": torch.tensor(0.5),
        "1-d": torch.tensor([0.5]),
    }[make]
    with pytest.raises(ValueError) as info:
        FusedHeadConfig(backend="ref-test", **{field: value})
    assert f"field {field!r} = tensor(" in str(info.value), info.value
    assert "(torch.Tensor): must be a float, got a torch.Tensor" in str(info.value), info.value


def test_bogus_device_is_a_value_error_naming_device(ref_backend):
    with pytest.raises(ValueError, match=r"field 'device' = 'bogus'.*torch device") as info:
        FusedHeadConfig.from_yaml("backend: ref-test\ndevice: bogus\n")
    _no_pydantic_dump(str(info.value))
    assert FusedHeadConfig(backend="ref-test", device="cuda:1").device == "cuda:1"


def test_model_validate_gives_the_same_clean_errors(ref_backend):
    with pytest.raises(
        TypeError, match=r"field 'temperature' = True \(bool\): expected float"
    ) as info:
        FusedHeadConfig.model_validate({"backend": "ref-test", "temperature": True})
    _no_pydantic_dump(str(info.value))


def test_unknown_field_suggests_the_close_one(ref_backend):
    with pytest.raises(ValueError, match=r"unknown field 'temperatur'.*did you mean 'temperature'"):
        FusedHeadConfig(backend="ref-test", temperatur=0.5)


def test_require_takes_a_tuple_and_round_trips(strict_backend):
    cfg = FusedHeadConfig(
        backend="strict-test", require=("deterministic",), options={"shape": (3, 4)}
    )
    assert cfg.require == ["deterministic"]
    assert FusedHeadConfig.from_dict(cfg.to_dict()) == cfg  # a list for the tuple after JSON


# --- backend options ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,option,shown",
    [
        ({"tile": True}, "tile", "True (bool)"),
        ({"tile": "3"}, "tile", "'3' (str)"),
        ({"tile": 2.0}, "tile", "2.0 (float)"),
        ({"scale": "1.5"}, "scale", "'1.5' (str)"),
        ({"exact": 1}, "exact", "1 (int)"),
        ({"exact": "true"}, "exact", "'true' (str)"),
        ({"mode": "fastest"}, "mode", "'fastest' (str)"),
    ],
)
def test_options_do_not_coerce(strict_backend, options, option, shown):
    with pytest.raises(OptionsError) as info:
        FusedHeadConfig(backend="strict-test", options=options)
    exc = info.value
    assert isinstance(exc, ValueError) and isinstance(exc, BackendError)
    msg = str(exc)
    assert f"option {option!r} = {shown}: expected" in msg, msg
    assert exc.backend == "strict-test" and exc.option == option
    _no_pydantic_dump(msg)
    for sig in option_signatures(StrictOptions):  # every valid option, name: type = default
        assert sig in msg
    assert "tile: int > 0 or None = None" in msg and "mode: one of 'fast', 'safe' = 'fast'" in msg


def test_options_error_fields_and_json(strict_backend):
    with pytest.raises(OptionsError) as info:
        validate_options("strict-test", strict_backend, {"tiel": 4})
    data = info.value.to_dict()
    assert data["status"] == "invalid-options" and data["backend"] == "strict-test"
    assert data["option"] == "tiel" and "did you mean 'tile'" in data["reason"]
    assert data["valid_options"] == option_signatures(StrictOptions)


def test_options_error_of_an_installed_backend_names_its_distribution():
    with pytest.raises(OptionsError) as info:
        FusedHeadConfig(backend="torch", options={"workspace_mib": True})
    exc = info.value
    assert exc.distribution == "fusedhead-torch" and exc.option == "workspace_mib"
    assert "backend 'torch' (fusedhead-torch" in str(exc)
    assert exc.expected == "int > 0 or None"


def test_valid_options_still_validate(strict_backend):
    cfg = FusedHeadConfig(
        backend="strict-test", options={"tile": 4, "scale": 2, "exact": True, "mode": "safe"}
    )
    assert cfg.options == {"tile": 4, "scale": 2.0, "exact": True, "mode": "safe"}
    opts = validate_options("strict-test", strict_backend, cfg.options)
    assert isinstance(opts, StrictOptions) and opts.scale == 2.0


def test_options_that_are_not_a_mapping_are_a_type_error(strict_backend):
    with pytest.raises(TypeError, match=r"options for backend 'strict-test' must be a mapping"):
        validate_options("strict-test", strict_backend, [("tile", 4)])


# --- type descriptions ----------------------------------------------------------------------------


def _field(name: str) -> Any:
    return StrictOptions.model_fields[name]


@pytest.mark.parametrize(
    "annotation,metadata,text",
    [
        (Optional[PositiveInt], (), "int > 0 or None"),  # noqa: UP045 (the Optional spelling too)
        (PositiveInt | None, (), "int > 0 or None"),
        (Literal["a", "b"], (), "one of 'a', 'b'"),
        (Literal["a", "b"] | None, (), "one of 'a', 'b' or None"),
        (bool | None, (), "bool or None"),
        (float, tuple(_field("scale").metadata), "float > 0"),
        (int, (), "int"),
    ],
)
def test_describe_type(annotation, metadata, text):
    assert describe_type(annotation, metadata) == text


class RequiredOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    chunk: int
    policy: str = "required"  # a str default that happens to read "required"


def test_an_option_without_a_default_reads_as_required_not_as_a_str_default(ref_backend):
    """Before: 'chunk: int = 'required'', the look of a str default."""
    assert option_signatures(RequiredOptions) == [
        "chunk: int (required)",
        "policy: str = 'required'",
    ]

    class NeedsChunk(ref_backend):  # type: ignore[misc,valid-type]
        name: ClassVar[str] = "needs-chunk-test"
        Options: ClassVar[type[BaseModel]] = RequiredOptions

    with pytest.raises(OptionsError) as info:
        validate_options("needs-chunk-test", NeedsChunk, {})
    assert "option 'chunk' is required: expected int" in str(info.value)
    assert "valid options of 'needs-chunk-test': chunk: int (required), policy: str = " in str(
        info.value
    )
    assert info.value.valid_options == ("chunk: int (required)", "policy: str = 'required'")
