"""Property-based cases with hypothesis: random shapes, scales, temperatures and label patterns.

A bounded, derandomized search (the same examples every run, no example database written), so
the kit's time and verdict are reproducible. The failing example is named in the message.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fusedhead.testing.inputs import Case, make_case
from fusedhead.testing.measure import check_against_reference
from fusedhead.testing.outcome import NotRun, PropertyFailure
from fusedhead.testing.target import Target

PATTERNS = (
    "random",
    "none ignored",
    "all ignored",
    "half ignored",
    "first and last token",
    "one repeated label",
)


def _labels(pattern: str, n: int, v: int, ignore_index: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[labels == ignore_index] = (ignore_index + 1) % v  # "none ignored" must mean none
    if pattern == "random":
        labels[torch.rand(n, generator=g) < 0.1] = ignore_index
    elif pattern == "all ignored":
        labels[:] = ignore_index
    elif pattern == "half ignored":
        labels[::2] = ignore_index
    elif pattern == "first and last token":
        labels = torch.where(torch.rand(n, generator=g) < 0.5, 0, v - 1)
    elif pattern == "one repeated label":
        labels[:] = int(torch.randint(0, v, (1,), generator=g))
    return labels


def hypothesis_cases(target: Target) -> None:
    """Random (N, H, V), input scale, temperature 0.05..20 (from the declared min_temperature, if higher), ignore_index and label patterns match float64."""
    try:
        from hypothesis import HealthCheck, Phase, Verbosity, given, settings
        from hypothesis import strategies as st
        from hypothesis.errors import FlakyFailure
    except ImportError as exc:
        from fusedhead.install_hints import extra_command

        raise NotRun(f"hypothesis is not installed: {extra_command('testing')}") from exc
    big = target.device.type != "cpu"
    max_n, max_h, max_v = (300, 300, 3000) if big else (24, 48, 160)
    low, high = target.temperature_range(0.05, 20.0)

    problems = st.fixed_dictionaries(
        {
            "n": st.integers(1, max_n),
            "h": st.integers(1, max_h),
            "v": st.integers(2, max_v),
            "scale": st.sampled_from([0.1, 1.0, 4.0, 10.0]),
            # rounded for the message, then kept at or above the declared minimum
            "temperature": st.floats(math.log(low), math.log(high)).map(
                lambda x: target.allowed_temperature(round(math.exp(x), 4))
            ),
            "ignore_index": st.sampled_from([-100, -1, 0, 3]),
            "pattern": st.sampled_from(PATTERNS),
            "seed": st.integers(0, 2**16),
        }
    )

    @settings(
        max_examples=target.sizes.examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
    )
    @given(problems)
    def run(p: dict[str, Any]) -> None:
        base = make_case(
            p["n"], p["h"], p["v"], scale=p["scale"], seed=p["seed"], ignore_fraction=0.0
        )
        labels = _labels(p["pattern"], p["n"], p["v"], p["ignore_index"], p["seed"])
        case = Case(base.hidden, base.weight, labels, base.description).to(
            target.device, target.dtype
        )
        label = (
            f"hypothesis example N={p['n']} H={p['h']} V={p['v']} s={p['scale']} "
            f"temperature={p['temperature']} ignore_index={p['ignore_index']} labels: {p['pattern']} "
            f"(seed {p['seed']})"
        )
        check_against_reference(
            target,
            case,
            label=label,
            temperature=p["temperature"],
            ignore_index=p["ignore_index"],
            seed=p["seed"],
        )

    try:
        run()
    except FlakyFailure as exc:  # an example that failed, then passed when hypothesis re-ran it
        first = exc.exceptions[0] if exc.exceptions else exc
        raise PropertyFailure(
            "an example failed and then passed when hypothesis ran it again: the backend's "
            f"results differ from run to run on the same inputs. The failure: {first}"
        ) from None


RANDOMIZED = {"hypothesis_cases": hypothesis_cases}
