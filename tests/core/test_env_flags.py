"""On/off environment variables read one way: the on and off words in any case, blank as off,
and anything else an error naming the variable (never silently on or off)."""

from __future__ import annotations

import pytest

from fusedhead.env_flags import env_flag

NAME = "FUSEDHEAD_TEST_FLAG"


@pytest.mark.parametrize("raw", ["1", "true", "YES", " on "])
def test_the_on_words_are_on(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(NAME, raw)
    assert env_flag(NAME) is True


@pytest.mark.parametrize("raw", ["0", "False", "no", "OFF", "", "  "])
def test_the_off_words_and_blank_are_off(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(NAME, raw)
    assert env_flag(NAME) is False


def test_unset_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert env_flag(NAME) is False


@pytest.mark.parametrize("raw", ["maybe", "2", "of"])
def test_another_value_is_an_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv(NAME, raw)
    with pytest.raises(ValueError) as info:
        env_flag(NAME)
    assert str(info.value).startswith(f"{NAME}={raw!r} is not an on/off value: expected one of")
