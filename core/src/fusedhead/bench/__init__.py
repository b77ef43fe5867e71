"""``fusedhead bench``: backends and peers side by side in GEMM units, peak memory and accuracy.

Modules by job: ``cases`` (grid and inputs), ``peers`` (what is measured), ``timing``, ``memory``,
``accuracy``, ``measure`` (one implementation on one case), ``report`` (JSON, Markdown, plots) and
``cli`` (arguments and the loop). Nothing here is imported by ``import fusedhead``.
"""
