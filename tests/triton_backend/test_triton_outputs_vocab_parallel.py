"""lse, sum_p2, argmax and gather under ``process_group`` on the triton backend (2 and 3 gloo CPU
ranks, interpreter, uneven shards): every rank gets the one-process values and gradients, the
argmax exactly (the lowest id among the ranks' maxima, ties across shards included), gathered at
the labels bitwise the log-probs; top-k is refused there by name."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from fusedhead.protocol import HeadCall

pytestmark = pytest.mark.multiprocess
N, H, V, K = 27, 40, 200, 7
IGNORE = -100
TILES: dict[str, Any] = {"block_m": 32, "block_n": 64, "block_k": 32, "backward_block_mib": 1e-3}
#: world -> shard bounds (uneven; a shard boundary inside a tile).
BOUNDS = {2: [0, 77, 200], 3: [0, 64, 150, 200]}
FLOATS = ("log_probs", "entropy", "lse", "sum_p2", "gathered")
EXTRAS = frozenset({"lse", "sum_p2", "argmax"})


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(77)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::6] = IGNORE
    weight = torch.randn(V, H, generator=g) / H**0.5
    weight[150] = weight[20]  # equal logits at ids 20 and 150 (different shards) in every row
    hidden = torch.randn(N, H, generator=g)
    ids = torch.randint(0, V, (N, K), generator=g)
    ids[:, 0] = labels.clamp(min=0)
    ids[:, 1] = ids[:, 2]
    ids[:, -1] = IGNORE
    ids[:, 3] = 76  # the last id of shard 0 (2 ranks)
    ids[:, 4] = 77  # the first of shard 1
    # Make id 20 (= 150) the row max in rows 1-3 (row 0 is ignored): argmax ties across shards.
    hidden[1:4] = weight[20] * 8
    return {
        "hidden": hidden,
        "weight": weight,
        "labels": labels,
        "ids": ids,
        "temps": torch.rand(N, generator=g) + 0.5,
        **{f"g_{f}": torch.randn((N, K) if f == "gathered" else (N,), generator=g) for f in FLOATS},
    }


def run(x: dict[str, torch.Tensor], lo: int, hi: int, group: Any) -> dict[str, Any]:
    """Every extra on rows [lo, hi) of the weight, a loss through each float one, its gradients."""
    from fusedhead_triton import TritonBackend, TritonOptions

    h = x["hidden"].clone().requires_grad_()
    w = x["weight"][lo:hi].clone().requires_grad_()
    call = HeadCall.make(
        h, w, x["labels"], temperature=x["temps"], ignore_index=IGNORE, process_group=group,
        vocab_start=lo, vocab_size=V, extras=EXTRAS, gather_ids=x["ids"], softcap=4.0,
    )  # fmt: skip
    out = TritonBackend(TritonOptions(**TILES)).forward(call)
    res: dict[str, Any] = {f: getattr(out, f) for f in (*FLOATS, "argmax")}
    loss = sum((res[f].double() * x[f"g_{f}"].double()).sum() for f in FLOATS)
    loss.backward()
    res = {k: v.detach() for k, v in res.items()}
    res["d_hidden"], res["d_weight"] = h.grad, w.grad
    try:
        topk = call._replace(top_k=2, outputs=call.outputs | {"topk"})
        TritonBackend(TritonOptions(**TILES)).forward(topk)
        res["topk_error"] = ""
    except ValueError as e:
        res["topk_error"] = str(e)
    return res


def worker(rank: int, world: int, port: int, out: str) -> None:
    """mp.spawn target: join the gloo group, run on this rank's shard, save."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        b = BOUNDS[world]
        torch.save(run(inputs(), b[rank], b[rank + 1], dist.group.WORLD), Path(out) / f"{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        return run(inputs(), 0, V, None)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_one_process_outputs(world, single, tmp_path) -> None:
    mp.spawn(worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    b = BOUNDS[world]
    x = inputs()
    valid = x["labels"] != IGNORE
    assert bool((single["argmax"][1:4] == 20).all())  # the tie across shards, lower id
    for r, got in enumerate(ranks):
        for f in FLOATS:
            scale = max(1.0, float(single[f].abs().max()))
            err = float((got[f] - single[f]).abs().max())
            assert err <= 2e-6 * scale, f"rank {r} {f}: {err:.3g}"
        assert torch.equal(got["argmax"], single["argmax"]), r
        assert torch.equal(got["gathered"][:, 0], got["log_probs"]), r
        assert bool((got["gathered"][:, -1] == 0).all())
        assert bool((got["lse"][~valid] == 0).all()) and bool((got["argmax"][~valid] == -1).all())
        dh_err = float((got["d_hidden"] - single["d_hidden"]).abs().max())
        assert dh_err <= 1e-5 * float(single["d_hidden"].abs().max()), r
        want_dw = single["d_weight"][b[r] : b[r + 1]]
        dw_err = float((got["d_weight"] - want_dw).abs().max())
        assert dw_err <= 1e-5 * float(single["d_weight"].abs().max()), r
        assert "top_k" in got["topk_error"] and "process_group" in got["topk_error"]
