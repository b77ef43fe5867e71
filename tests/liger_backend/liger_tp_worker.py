"""One rank of the vocab-parallel check: ``python liger_tp_worker.py RANK WORLD RENDEZVOUS OUT``
(append ``shards`` to run only the disagreeing-shard cases).

Every rank builds the same full inputs from a seed, keeps its vocabulary shard of the weight and
runs the ``liger`` backend (fallback) over gloo, with ``reduce_hidden_grad`` True and False; the
outputs and gradients go to ``OUT`` (torch.save) for the test to compare with one process. With
``shards``, each rank calls it on shards that disagree (``SHARD_CASES``) and records what each call
raised, in processes of their own: a missing check hangs or misleads those, not the runs above.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from fusedhead.protocol import call_backend

N, H, V, T = 600, 32, 1000, 0.7
IGNORE = -100
BAD_ROW = 5  # gets a label >= V: NaN on every rank, never a crash


def full_inputs() -> dict[str, torch.Tensor]:
    """The unsharded problem, the same on every rank."""
    gen = torch.Generator().manual_seed(1234)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < 0.1] = IGNORE
    labels[BAD_ROW] = V + 7
    return {
        "hidden": torch.randn(N, H, generator=gen),
        "weight": torch.randn(V, H, generator=gen) / H**0.5,
        "labels": labels,
        "g_lp": torch.randn(N, generator=gen),
        "g_ent": torch.randn(N, generator=gen),
    }


def run(rank: int, world: int, x: dict[str, torch.Tensor], reduce_hidden_grad: bool, entropy: bool):
    from fusedhead_liger import LigerBackend, LigerOptions

    backend = LigerBackend(LigerOptions(implementation="fallback"))
    local = V // world
    h = x["hidden"].clone().requires_grad_()
    w = x["weight"][rank * local : (rank + 1) * local].clone().requires_grad_()
    lp, ent = call_backend(
        backend,
        h,
        w,
        x["labels"],
        temperature=T,
        ignore_index=IGNORE,
        return_entropy=entropy,
        process_group=dist.group.WORLD,
        vocab_start=rank * local,
        vocab_size=V,
        reduce_hidden_grad=reduce_hidden_grad,
    )
    ok = x["labels"] != V + 7
    loss = (lp[ok] * x["g_lp"][ok]).sum()
    if entropy:
        loss = loss + (ent[ok] * x["g_ent"][ok]).sum()
    loss.backward()
    return {
        "lp": lp.detach(),
        "ent": None if ent is None else ent.detach(),
        "dh": h.grad,
        "dw": w.grad,
    }


#: name -> per rank (vocab_start, local rows, vocab_size) for two ranks; None: the core's default.
#: The two "unequal" cases pass each rank's own equal-shard check (each rank's view of its shard
#: is consistent) yet the ranks disagree; "gap" and "overlap" fail that check on both ranks.
SHARD_CASES: dict[str, list[tuple[int | None, int, int | None]]] = {
    "unequal_rows": [(0, 400, 800), (600, 600, 1200)],
    "unequal_core_defaults": [(None, 400, None), (None, 600, None)],
    "gap": [(0, 400, 1000), (500, 400, 1000)],
    "overlap": [(0, 600, 1000), (400, 600, 1000)],
    "out_of_order": [(500, 500, 1000), (0, 500, 1000)],
    "covered_again": [(0, 500, 1000), (500, 500, 1000)],
}


def shard_cases(rank: int, x: dict[str, torch.Tensor]) -> dict[str, tuple[str, Any]]:
    """Each case's outcome on this rank: ("ok", log-probs) or (exception name, message)."""
    from fusedhead_liger import LigerBackend, LigerOptions

    backend = LigerBackend(LigerOptions(implementation="fallback"))
    # Ids below every case's smallest vocab_size (800): the core checks labels before the backend
    # on each rank alone, and a rank stopped there would leave the others in a collective.
    labels = torch.where(x["labels"] == IGNORE, IGNORE, x["labels"] % 800)
    rows = x["weight"].repeat(2, 1)  # enough rows for a shard past V (their values do not matter)
    results: dict[str, tuple[str, Any]] = {}
    for name, shards in SHARD_CASES.items():
        start, width, size = shards[rank]
        first = (rank * width) if start is None else start
        w = rows[first : first + width].contiguous()
        try:
            if name.endswith("core_defaults"):
                from fusedhead.api import fused_head

                lp, _ = fused_head(
                    x["hidden"], w, labels, backend="liger", temperature=T,
                    options={"implementation": "fallback"}, process_group=dist.group.WORLD,
                )  # fmt: skip
            else:
                lp, _ = call_backend(
                    backend, x["hidden"], w, labels, temperature=T, ignore_index=IGNORE,
                    return_entropy=True, process_group=dist.group.WORLD, vocab_start=start,
                    vocab_size=size, reduce_hidden_grad=True,
                )  # fmt: skip
            results[name] = ("ok", lp.detach())
        except Exception as exc:  # what each rank raised, to compare across ranks
            results[name] = (type(exc).__name__, str(exc))
    return results


def main() -> None:
    rank, world, rendezvous, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    # One thread, as the other gloo workers: a BLAS that picks its threads by the machine's load
    # rounds the same product differently from one spawn to the next (1.1e-6 apart, or equal),
    # and the tests compare values from two spawns.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        x = full_inputs()
        if sys.argv[5:] == ["shards"]:
            torch.save(shard_cases(rank, x), out)
            return
        results = {
            "reduce": run(rank, world, x, True, True),
            "partial": run(rank, world, x, False, True),
            "no_entropy": run(rank, world, x, True, False),
        }
        try:
            from fusedhead.api import fused_head

            h = x["hidden"].clone().requires_grad_()
            local = V // world
            w = x["weight"][rank * local : (rank + 1) * local].clone().requires_grad_()
            good = x["labels"].clone()
            good[BAD_ROW] = IGNORE
            lp, ent = fused_head(
                h,
                w,
                good,
                backend="liger",
                temperature=T,
                options={"implementation": "fallback"},
                process_group=dist.group.WORLD,
            )
            (lp * x["g_lp"] + ent * x["g_ent"]).sum().backward()
            results["core"] = {"lp": lp.detach(), "ent": ent.detach(), "dh": h.grad, "dw": w.grad}
        except ImportError:
            pass
        torch.save(results, out)
    finally:
        dist.barrier()  # gloo can abort a process torn down while a peer still talks
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Saved and the process group destroyed: leave without the interpreter's teardown, where
    # gloo's worker threads can abort a finished rank (scripts/gpu/vocab_parallel_nccl.py's note).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
