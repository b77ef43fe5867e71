"""``python -m fusedhead``: the ``fusedhead`` command."""

from __future__ import annotations

from fusedhead.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
