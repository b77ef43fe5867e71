"""Rules the Triton compiler enforces on kernel modules but the CPU interpreter does not.

The interpreter runs ``@triton.jit`` functions as Python, so a kernel that reads a plain
module-level global passes every CPU test and fails to compile on a GPU. The compiler accepts
only globals made with ``tl.constexpr(value)``; an annotation (``X: tl.constexpr = 1``) is not
enough (seen on an H200 with triton 3.6).
"""

from __future__ import annotations

import ast
from pathlib import Path

import fusedhead_triton

KERNELS = Path(fusedhead_triton.__file__).parent / "kernels"


def _module_globals(tree: ast.Module) -> list[ast.stmt]:
    return [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))]


def test_kernel_module_globals_are_made_with_tl_constexpr() -> None:
    bad = []
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in _module_globals(tree):
            value = node.value
            made = (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Attribute)
                and value.func.attr == "constexpr"
            )
            if isinstance(node, ast.AnnAssign) or not made:
                bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "module globals a kernel could read must be tl.constexpr(...):\n" + "\n".join(
        bad
    )
