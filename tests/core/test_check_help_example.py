"""``fusedhead check --help`` shows an ``--options`` example that the backend it names takes."""

from __future__ import annotations

import argparse
import json
import re

from fusedhead.testing.runner import add_arguments
from fusedhead_torch import TorchOptions


def test_the_options_example_is_a_valid_torch_option() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (action,) = [a for a in parser._actions if "--options" in a.option_strings]
    assert action.help is not None and "(torch's)" in action.help
    example = re.search(r"'(\{.*\})'", action.help)
    assert example is not None, action.help
    TorchOptions(**json.loads(example.group(1)))  # an unknown option would raise here
