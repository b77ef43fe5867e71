"""Every error class carries its facts as fields, and its message is built from them."""

from __future__ import annotations

import pytest

from fusedhead.errors import (
    ERROR_CLASSES,
    BackendConflictError,
    BackendContractError,
    BackendError,
    BackendLoadError,
    BackendUnavailableError,
    CapabilityError,
    IncompatibleBackendError,
    MissingDependencyError,
    OptionsError,
    UnknownBackendError,
)

WHO = {"backend": "demo", "distribution": "fh-demo", "version": "1.2.3"}

#: One error of each class, and the one message it must give.
CASES = [
    (
        BackendError("went wrong", hint="try again", **WHO),
        "backend 'demo' (fh-demo 1.2.3): went wrong. Fix: try again",
    ),
    (
        UnknownBackendError("unknown fusedhead backend 'demo'. Installed: torch.", backend="demo"),
        "unknown fusedhead backend 'demo'. Installed: torch.",
    ),
    (
        MissingDependencyError(
            "could not be imported: the package 'xyz' is not installed",
            missing="xyz",
            hint="pip install xyz",
            **WHO,
        ),
        "backend 'demo' (fh-demo 1.2.3): could not be imported: the package 'xyz' is not "
        "installed. Fix: pip install xyz",
    ),
    (
        BackendLoadError("has no method forward()", hint="define forward(self, call)", **WHO),
        "backend 'demo' (fh-demo 1.2.3): has no method forward(). Fix: define forward(self, call)",
    ),
    (
        BackendConflictError(
            "is claimed by 2 distributions: a; b", claimants=("a", "b"), backend="demo"
        ),
        "backend 'demo': is claimed by 2 distributions: a; b",
    ),
    (
        IncompatibleBackendError(
            "speaks plugin API version 1; this fusedhead supports 2..2", **WHO
        ),
        "backend 'demo' (fh-demo 1.2.3): speaks plugin API version 1; this fusedhead supports 2..2",
    ),
    (
        BackendUnavailableError("runs on CUDA only", hint="use backend='torch'"),
        "runs on CUDA only. Fix: use backend='torch'",
    ),
    (
        CapabilityError("does not support softcap", capability="softcap", backend="demo"),
        "backend 'demo': does not support softcap",
    ),
    (
        BackendContractError("broke the plugin contract: log_probs must be float32", **WHO),
        "backend 'demo' (fh-demo 1.2.3): broke the plugin contract: log_probs must be float32",
    ),
    (
        OptionsError(
            "option 'tile' must be int > 0, got True",
            option="tile",
            expected="int > 0",
            valid_options=("tile: int > 0 = 64",),
            **WHO,
        ),
        "backend 'demo' (fh-demo 1.2.3): option 'tile' must be int > 0, got True",
    ),
]


def test_every_class_has_a_case() -> None:
    assert {type(e) for e, _ in CASES} == set(ERROR_CLASSES)


@pytest.mark.parametrize(("error", "message"), CASES, ids=lambda c: type(c).__name__)
def test_the_message_is_built_from_the_fields(error: BackendError, message: str) -> None:
    assert str(error) == message == error.message
    fields = error.to_dict()
    assert fields["error"] == type(error).__name__
    assert fields["status"] == type(error).status
    for key in ("backend", "distribution", "version", "reason", "hint"):
        assert fields[key] == getattr(error, key)
    assert isinstance(error, BackendError) and isinstance(error, RuntimeError)


def test_class_specific_fields() -> None:
    assert MissingDependencyError("x", missing="xyz").to_dict()["missing"] == "xyz"
    assert BackendConflictError("x", claimants=("a", "b")).to_dict()["claimants"] == ["a", "b"]
    assert CapabilityError("x", capability="softcap").to_dict()["capability"] == "softcap"
    options = OptionsError("x", option="tile", expected="int", valid_options=("tile: int = 1",))
    assert options.to_dict()["valid_options"] == ["tile: int = 1"]
    assert isinstance(options, ValueError)


def test_each_class_names_the_status_that_listings_show() -> None:
    statuses = {cls.__name__: cls.status for cls in ERROR_CLASSES}
    assert statuses == {
        "BackendError": "error",
        "UnknownBackendError": "unknown",
        "MissingDependencyError": "broken",
        "BackendLoadError": "broken",
        "BackendConflictError": "conflict",
        "IncompatibleBackendError": "incompatible",
        "BackendUnavailableError": "unavailable",
        "CapabilityError": "missing-capability",
        "BackendContractError": "broken",
        "OptionsError": "invalid-options",
    }


def test_attach_fills_only_what_the_raiser_left_out() -> None:
    raised = BackendUnavailableError("no GPU", hint="use cpu")
    assert raised.attach(**WHO) is raised
    assert str(raised) == "backend 'demo' (fh-demo 1.2.3): no GPU. Fix: use cpu"
    own = BackendUnavailableError("no GPU", backend="mine").attach(**WHO)
    assert own.backend == "mine" and own.distribution == "fh-demo"


def test_the_python_bases_stay_catchable() -> None:
    assert isinstance(UnknownBackendError("x"), KeyError)
    assert isinstance(MissingDependencyError("x"), ImportError)
    assert str(UnknownBackendError("unknown 'x'")) == "unknown 'x'"  # not KeyError's quoting
