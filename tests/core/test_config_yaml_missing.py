"""``from_yaml`` without PyYAML names what is missing and how to get it, not a bare import error."""

from __future__ import annotations

import sys

import pytest

from fusedhead.config import FusedHeadConfig


def test_from_yaml_without_pyyaml_names_the_package_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml -> ModuleNotFoundError
    with pytest.raises(ModuleNotFoundError) as info:
        FusedHeadConfig.from_yaml("backend: torch")
    text = str(info.value)
    assert "from_yaml needs PyYAML" in text and "pip install 'pyyaml>=6'" in text
    assert info.value.name == "yaml"
