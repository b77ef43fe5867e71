"""A backend's options, checked strictly against its ``Options`` model, and options described in
words (for errors, ``fusedhead info`` and the docs). The registry resolves a backend's options
through ``validate_options``; the config describes its own fields with the same words.
"""

from __future__ import annotations

import difflib
import enum
import json
import numbers
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fusedhead.errors import BackendError, OptionsError, type_name

if TYPE_CHECKING:  # pydantic is imported where options are validated: the registry imports this
    from pydantic import BaseModel, ValidationError

# --- type descriptions: what a field takes, in words (for errors, `fusedhead info` and the docs) --


def _bounds(metadata: Sequence[Any]) -> list[str]:
    out: list[str] = []
    for meta in metadata:
        for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            bound = getattr(meta, attr, None)
            if bound is not None:
                out.append(f"{sym} {bound}")
        for attr, word in (
            ("multiple_of", "a multiple of"),
            ("min_length", "length >="),
            ("max_length", "length <="),
        ):
            bound = getattr(meta, attr, None)
            if bound is not None:
                out.append(f"{word} {bound}")
    return out


def describe_type(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    """A field's allowed values in words: ``int > 0 or None``, ``one of 'a', 'b'``, ``bool``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return describe_type(args[0], [*args[1:], *metadata])
    if origin is typing.Union or origin is types.UnionType:
        # Bounds of an optional field (``Field(gt=0)`` on ``float | None``) bound its values.
        parts = [describe_type(a, metadata) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return text + " or None" if type(None) in args else text
    if origin is typing.Literal:
        text = "one of " + ", ".join(repr(a) for a in args) if len(args) > 1 else repr(args[0])
    elif annotation is type(None) or annotation is None:
        text = "None"
    elif annotation is Any:
        text = "any value"
    elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        text = "one of " + ", ".join(repr(m.value) for m in annotation)
    elif isinstance(annotation, type) and origin is None:
        text = annotation.__name__
    else:
        text = str(annotation).replace("typing.", "")
    bounds = _bounds(metadata)
    return " ".join([text, *bounds]) if bounds else text


def _field_default(field: Any) -> Any:
    return None if field.is_required() else field.get_default(call_default_factory=True)


def option_rows(model: type[BaseModel]) -> list[dict[str, Any]]:
    """Each field of ``model``: name, allowed values in words, default, description, and whether
    it is required (then ``default`` is None: a required option has none)."""
    return [
        {
            "name": name,
            "type": describe_type(field.annotation, field.metadata),
            "default": _field_default(field),
            "description": field.description or "",
            "required": field.is_required(),
        }
        for name, field in model.model_fields.items()
    ]


def option_signature(row: Mapping[str, Any]) -> str:
    """``name: type = default``, or ``name: type (required)``, for a row of :func:`option_rows`."""
    if row["required"]:
        return f"{row['name']}: {row['type']} (required)"
    return f"{row['name']}: {row['type']} = {row['default']!r}"


def option_signatures(model: type[BaseModel]) -> list[str]:
    """``name: type = default`` (``name: type (required)`` for one without a default) for every
    field of ``model`` (what an options error lists)."""
    return [option_signature(r) for r in option_rows(model)]


# --- turning pydantic's errors into one line that names the field, the value and the expectation --


def _show(value: Any) -> str:
    """A value as an error shows it: its repr (cut short) and its type."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20:
        return f"an int of {len(str(abs(value)))} digits"
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type_name(value)})"


_NO_DETAIL = ("_type", "literal_error", "greater_than", "less_than", "multiple_of", "enum")


def problems(
    exc: ValidationError, model: type[BaseModel], what: str
) -> tuple[list[str], str | None, str | None, bool]:
    """(one phrase per field, the first field, its expectation, whether all are type errors)."""
    phrases: list[str] = []
    seen: set[str] = set()
    first: str | None = None
    first_expected: str | None = None
    all_type = True
    fields = model.model_fields
    for err in exc.errors():
        loc = err.get("loc", ())
        name = str(loc[0]) if loc else ""
        if name in seen:  # one phrase per field (a union reports once per member)
            continue
        seen.add(name)
        kind = str(err.get("type", ""))
        all_type = all_type and kind.endswith("_type")
        ctx_error = (err.get("ctx") or {}).get("error")
        detail = str(ctx_error) if ctx_error is not None else str(err.get("msg", ""))
        if kind == "extra_forbidden":
            close = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.6)
            phrase = f"unknown {what} {name!r} = {_show(err.get('input'))}" + (
                f" (did you mean {close[0]!r}?)" if close else ""
            )
            expected = None
        elif name in fields:
            field = fields[name]
            expected = describe_type(field.annotation, field.metadata)
            inner = loc[1:]
            if inner and inner[-1] == "[key]":  # a mapping's key of the wrong type
                phrase = (
                    f"{what} {name!r} has the key {_show(err.get('input'))}: expected {expected}"
                )
            elif inner and kind.endswith("_type"):  # an item of a list, tuple or mapping
                where = "".join(f"[{part!r}]" for part in inner)
                phrase = f"{what} {name!r}{where} = {_show(err.get('input'))}: expected {expected}"
            elif kind == "missing":
                phrase = f"{what} {name!r} is required: expected {expected}"
            elif kind == "value_error":  # the field's own check says what it takes
                phrase = f"{what} {name!r} = {_show(err.get('input'))}: {detail}"
            else:
                phrase = f"{what} {name!r} = {_show(err.get('input'))}: expected {expected}"
                if not any(kind.endswith(s) or kind.startswith(s) for s in _NO_DETAIL):
                    phrase += f" ({detail})"
        else:  # a model-level check
            expected = None
            phrase = detail
        if first is None:
            first, first_expected = name or None, expected
        phrases.append(phrase)
    return phrases, first, first_expected, all_type


def backend_error_inside(exc: ValidationError) -> BackendError | None:
    """The ``BackendError`` a validator raised inside ``exc`` (pydantic wraps it), or None."""
    for err in exc.errors():
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, BackendError):
            return inner
    return None


def _unknown_identity(name: str) -> tuple[str | None, str | None]:
    return None, None


#: (distribution, version) of a backend by name for an error message; the registry sets it
#: (this module imports no registry: the registry imports it).
identity_of: Callable[[str], tuple[str | None, str | None]] = _unknown_identity


def _identity(name: str) -> tuple[str | None, str | None]:
    """(distribution, version) of the backend ``name``; (None, None) if unknown."""
    try:
        return identity_of(name)
    except Exception:  # an error message must not fail on the lookup
        return None, None


def plain_number(value: Any) -> Any:
    """A NumPy number as the Python one its type stands for (``np.int64`` an int, ``np.float32``
    a float, ``np.bool_`` a bool, which a number option then refuses: it was taken as 1.0), as a
    call takes it; anything else as given."""
    cls = value.__class__
    if cls.__module__ == "numpy" and cls.__name__ in ("bool", "bool_"):
        return bool(value)
    if cls in (int, float, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def validate_options(name: str, cls: type, options: Any) -> BaseModel:
    """The backend's ``Options`` instance for ``options`` (a mapping, an Options instance or None).

    Strict: a value must already have the option's type (an int is taken for a float); ``True`` is
    not ``1`` and ``"3"`` is not ``3``. A JSON-shaped value (a list for a tuple) is accepted.
    Raises ``OptionsError`` (a ``ValueError``) naming the backend, its distribution, the option,
    the value, what was expected and every valid option.
    """
    from pydantic import BaseModel, ValidationError

    model: type[BaseModel] = cls.Options  # type: ignore[attr-defined]
    if options is None:
        options = {}
    if isinstance(options, model):
        return options
    if isinstance(options, BaseModel):
        options = options.model_dump()
    if not isinstance(options, Mapping):
        raise TypeError(
            f"options for backend {name!r} must be a mapping of option names to values, "
            f"got {type(options).__name__}"
        )
    data = {key: plain_number(value) for key, value in options.items()}
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        first_error = exc
    try:  # JSON-shaped values (lists for tuples, enum values) are what a config file holds
        return model.model_validate_json(json.dumps(data), strict=True)
    except (ValidationError, TypeError, ValueError):
        pass
    phrases, option, expected, _ = problems(first_error, model, "option")
    distribution, version = _identity(name)
    valid = option_signatures(model)
    raise OptionsError(
        "; ".join(phrases) + ".",
        option=option,
        expected=expected,
        valid_options=valid,
        backend=name,
        distribution=distribution,
        version=version,
        hint=(
            f"valid options of {name!r}: {', '.join(valid)}"
            if valid
            else f"backend {name!r} takes no options"
        )
        + " (values are taken as given: no conversion from bool or str).",
    ) from None


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: an object whose key repeats is refused (``json``
    keeps the last one silently: ``{"chunk_rows": 2, "chunk_rows": 3}`` ran with 3)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice in one JSON object; give it once")
        out[key] = value
    return out


def load_json(text: str) -> Any:
    """``json.loads`` that refuses a repeated key (``unique_pairs``); a ``ValueError`` either way
    (``json.JSONDecodeError`` for malformed text)."""
    return json.loads(text, object_pairs_hook=unique_pairs)


# --- the text that keys a cache of resolved heads by their options (or a config mapping) ---------


def _str_keys_only(value: Any, path: frozenset[int] = frozenset()) -> bool:
    """Whether every mapping in ``value`` (itself, or nested in mappings, lists and tuples) has
    str keys only; False for a container that holds itself (JSON cannot write a cycle)."""
    if not isinstance(value, (Mapping, list, tuple)):
        return True
    if id(value) in path:
        return False
    inner = path | {id(value)}
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _str_keys_only(v, inner) for k, v in value.items())
    return all(_str_keys_only(v, inner) for v in value)


def cache_text(mapping: Mapping[Any, Any]) -> str:
    """``mapping`` as the text that keys a cache: sorted JSON (values JSON cannot write by their
    repr) when every key in it is a str, else a repr of its items in a fixed order.

    Never raises, so that a key of the wrong type reaches validation, whose error names it:
    sorted JSON of ``{1: 2, "a": 3}`` raises Python's bare "'<' not supported between instances
    of 'str' and 'int'", and of ``{(1,): 2}`` "keys must be str, ...". The repr keeps ``1`` and
    ``"1"`` apart, which JSON (writing both as ``"1"``) would give one text.
    """
    if _str_keys_only(mapping):
        return json.dumps(dict(mapping), sort_keys=True, default=repr)
    items = sorted(mapping.items(), key=lambda kv: (type(kv[0]).__qualname__, repr(kv[0])))
    return "repr:" + repr(items)
