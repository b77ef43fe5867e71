"""Write docs/configuration.md from the models themselves: FusedHeadConfig and every first-party
backend's ``Options``, so the reference can never drift from the code (a test regenerates it)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from fusedhead.config import FusedHeadConfig, describe_type
from fusedhead.registry import load_class

FIRST_PARTY = ("torch", "triton", "liger")
OUT = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

HEADER = """# Configuration reference

Generated from the models by `python scripts/gen_config_docs.py`; a test fails when this file and
the code disagree.

A `FusedHeadConfig` loads from a dict (`FusedHeadConfig.from_dict`), YAML text or a YAML file
(`from_yaml(text)`, `from_yaml(pathlib.Path(...))`) or an OmegaConf/Hydra node
(`from_omegaconf`), and round-trips through `to_dict()`. In a YAML file the fields sit under one
`fused_head:` key, as below, or at the top; `from_dict` and `from_omegaconf` take the fields
themselves (pass the `fused_head` section). YAML needs PyYAML (the core's `yaml` extra:
`pip install './core[yaml]'` from a clone, `fusedhead[yaml]` once on PyPI); OmegaConf comes with
Hydra.

```yaml
fused_head:
  backend: triton            # exact name; see `fusedhead list`
  options: {}                # validated against the backend's Options below
  require: [batch_invariant] # capabilities checked at resolution; never used to pick a backend
  temperature: 0.7
```

Types are strict, in the config and in every backend's `options`, as they are in `fused_head`'s
arguments: no bool or string where a number is expected (YAML `temperature: yes` or
`workspace_mib: "3"` is an error, not 1.0 or 3), no number where a bool is; an int is taken for a
float.
Numbers in YAML are read by YAML 1.2's rules (its core schema), not PyYAML's YAML 1.1 ones:
`010` is 10 (not octal 8; octal is `0o10`), `1e-3` is a float, and `1:30` is a string (not
base-60 90), refused where a number is expected.
Unknown keys are errors. A malformed file names the file, the line and the column; a bad value
names the field or option, the value and what it takes, and a bad option lists every option of
that backend (`name: type = default`), as `fusedhead info NAME` shows them.

## Environment variables

| variable | effect |
| --- | --- |
| `FUSEDHEAD_BACKENDS` | a comma-separated list of backend names: discovery sees only those (for locked-down jobs; [selection.md](selection.md)). A name it hides is told so when asked for; blank, or only commas, limits nothing. Changed in a running process: `fusedhead.refresh()`, which forgets the heads already resolved. |
| `FUSEDHEAD_TRACEBACK` | `1`, `true`, `yes` or `on` (any case): the `fusedhead` command prints the traceback of an error (bad input's included) before its one line, with the same exit status; `0`, `false`, `no`, `off` or unset: the one line alone. Any other value is refused. |
| `FUSEDHEAD_VERL_FIX_TRL_PROBE` | on/off (`1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`, any case; unset or blank is off; another value is a warning naming the variable when verl is imported, and off): on, verl's plugin entry point applies `fusedhead.integrations.verl.fix_trl_value_head_probe()` in each process that imports verl ([integrations/verl.md](integrations/verl.md)). |
| `FUSEDHEAD_GIT_COMMIT` | the tree `fusedhead bench` records as `git_commit` where the machine's `.git` is not the tree's (the GPU scripts set it): one line of printable ASCII, at most 80 characters (e.g. `abc1234+dirty`); another value is refused by name before any measuring. |
"""


def _type(field: Any) -> str:
    """The field's allowed values in words (``int > 0 or None``), escaped for a Markdown table."""
    return describe_type(field.annotation, field.metadata).replace("|", "\\|")


def table(model: type[BaseModel]) -> str:
    rows = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        default = (
            "required"
            if field.is_required()
            else repr(field.get_default(call_default_factory=True))
        )
        desc = (field.description or "").replace("\n", " ")
        rows.append(f"| `{name}` | `{_type(field)}` | `{default}` | {desc} |")
    return "\n".join(rows)


def render() -> str:
    parts = [HEADER, "## FusedHeadConfig\n", table(FusedHeadConfig), ""]
    for name in FIRST_PARTY:
        cls = load_class(name)
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        parts += [
            f"## Backend `{name}` options\n",
            doc + "\n" if doc else "",
            table(cls.Options),
            "",
        ]
    return "\n".join(parts).rstrip() + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if OUT.exists() and OUT.read_text() == text else 1)
    OUT.write_text(text)
    print(f"wrote {OUT}")
