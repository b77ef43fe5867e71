"""Worker for the shard-union tests: each gloo rank calls a backend on shards that leave part of
``vocab_size`` uncovered (or overlap, or disagree on it), and records what each call raised."""

from __future__ import annotations

from typing import Any

import torch

N, H = 12, 16
WORLD = 2
#: name -> per rank (vocab_start, local rows, vocab_size; None: the default), and call keywords
#: ("label_at": a label set at a position on every rank).
CASES: dict[str, dict[str, Any]] = {
    "covered": {"shards": [(0, 8, 16), (8, 8, 16)], "kwargs": {}},
    "covered_uneven": {"shards": [(0, 5, 16), (5, 11, 16)], "kwargs": {"return_lse": True}},
    "gap_at_the_end": {"shards": [(0, 8, 20), (8, 8, 20)], "kwargs": {}},
    "gap_in_the_middle": {"shards": [(0, 8, 18), (10, 8, 18)], "kwargs": {}},
    "gap_with_extras": {"shards": [(0, 8, 20), (8, 8, 20)], "kwargs": {"return_lse": True}},
    "overlap": {"shards": [(0, 10, 18), (8, 10, 18)], "kwargs": {}},
    "sizes_differ": {"shards": [(0, 8, 16), (8, 8, 18)], "kwargs": {}},
    "covered_again": {"shards": [(0, 8, 16), (8, 8, 16)], "kwargs": {}},
    # Uneven shards with the defaults (vocab_start = rank x rows, vocab_size = world x rows):
    # rank 1's default is 12, so its labels 12..15 fail its range check alone; that check used
    # to raise before the collective, leaving rank 0 waiting in it.
    "uneven_defaults": {"shards": [(0, 10, None), (10, 6, None)], "kwargs": {}},
    # A label out of range on every rank: each raises it, after the collectives.
    "label_out_of_range": {"shards": [(0, 8, 16), (8, 8, 16)], "kwargs": {}, "label_at": (3, 16)},
}


def run(backend: str, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from fusedhead import fused_head

    options = {"block_m": 16, "block_n": 16, "block_k": 16} if backend == "triton" else {}
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(20, H, generator=g) / 4  # enough rows for every case's shard
    labels = torch.randint(0, 16, (N,), generator=g)
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        start, width, size = case["shards"][rank]
        y = labels.clone()
        if "label_at" in case:
            y[case["label_at"][0]] = case["label_at"][1]
        try:
            out = fused_head(
                hidden, weight[start : start + width].contiguous(), y, backend=backend,
                options=options, process_group=dist.group.WORLD,
                vocab_start=None if size is None else start, vocab_size=size, **case["kwargs"],
            )  # fmt: skip
            results[name] = ("ok", out.log_probs.clone())
        except Exception as exc:  # what each rank raised, to compare across ranks
            results[name] = (type(exc).__name__, str(exc))
    return results
