"""The same bits at any tensor-parallel degree (issue 33): on shards that start on the vocabulary
grid, vocab-parallel log-probs, entropy, lse, sum of squared p and gathered log-probs are the
one-process call's bits at degree 1, 2 and 4, on ``torch`` (gloo) and ``triton`` (interpreter),
through the public API; off the grid they stay as close as before. One spawn of four gloo ranks
runs every degree (subgroups of 1 and 2 ranks, the world of 4)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from fusedhead.shards import grid_shards

N, H, V, K = 16, 32, 4000, 3
IGNORE = -100
GRID = 1024
FLOATS = ("log_probs", "entropy", "lse", "sum_p2", "gathered")
#: (backend, dtype): bf16 only on torch (bf16 dots are wrong under the Triton interpreter).
CONFIGS = (
    ("torch", torch.float32),
    ("torch", torch.bfloat16),
    ("triton", torch.float32),
    ("triton", torch.float16),
)
#: Off the grid: a shard boundary inside a tile (the documented fallback: close, not bitwise).
OFF_GRID = [(0, 1500), (1500, V - 1500)]


def inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The full problem, the same on every rank."""
    g = torch.Generator().manual_seed(33)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = IGNORE
    ids = torch.randint(0, V, (N, K), generator=g)
    ids[:, 0] = labels.clamp(min=0)
    return {
        "hidden": torch.randn(N, H, generator=g).to(dtype),
        "weight": (torch.randn(V, H, generator=g) * (3.0 / H**0.5)).to(dtype),
        "labels": labels,
        "ids": ids,
        "temps": torch.rand(N, generator=g) + 0.5,
        "g": torch.randn(len(FLOATS) + K - 1, N, generator=g),
    }


def run(backend: str, dtype: torch.dtype, shard: tuple[int, int] | None, group: Any) -> dict:
    """Every float output of ``fused_head`` on ``shard`` (None: one process, the whole weight),
    and the hidden gradient of a loss through all of them."""
    from fusedhead import fused_head

    x = inputs(dtype)
    lo, rows = (0, V) if shard is None else shard
    h = x["hidden"].clone().requires_grad_()
    w = x["weight"][lo : lo + rows].clone().requires_grad_()
    kw: dict[str, Any] = {}
    if group is not None:
        kw = {"process_group": group, "vocab_start": lo, "vocab_size": V}
    out = fused_head(
        h, w, x["labels"], backend=backend, temperature=x["temps"], softcap=6.0,
        return_lse=True, return_sum_p2=True, gather_ids=x["ids"], **kw,
    )  # fmt: skip
    values = torch.stack([getattr(out, f) for f in FLOATS[:-1]] + list(out.gathered.T))
    (values.double() * x["g"].double()).sum().backward()
    return {"values": values.detach(), "d_hidden": h.grad, "d_weight": w.grad}


def worker(rank: int, world: int, port: int, out: str) -> None:
    """mp.spawn target: every config at degree 1, 2 and 4 and off the grid; saved per rank."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        groups = {
            deg: [dist.new_group(list(range(i, i + deg))) for i in range(0, world, deg)]
            for deg in (1, 2)
        }
        saved: dict[str, Any] = {}
        for backend, dtype in CONFIGS:
            for deg in (1, 2, 4):
                group = dist.group.WORLD if deg == world else groups[deg][rank // deg]
                shard = grid_shards(V, deg, GRID)[rank % deg]
                saved[f"{backend}-{dtype}-{deg}"] = run(backend, dtype, shard, group)
            pair = groups[2][rank // 2]
            saved[f"{backend}-{dtype}-off"] = run(backend, dtype, OFF_GRID[rank % 2], pair)
        torch.save(saved, Path(out) / f"{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("degrees")
    mp.spawn(worker, args=(4, _free_port(), str(out)), nprocs=4, join=True)
    return [torch.load(out / f"{r}.pt") for r in range(4)]


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        return {f"{b}-{d}": run(b, d, None, None) for b, d in CONFIGS}


def test_the_grid_layouts_lie_on_the_grid() -> None:
    assert grid_shards(V, 2, GRID) == [(0, 2048), (2048, 1952)]
    assert grid_shards(V, 4, GRID) == [(0, 1024), (1024, 1024), (2048, 1024), (3072, 928)]
    assert grid_shards(151936, 8, GRID)[-1] == (134144, 17792)  # 148.4 tiles: 19 x 5, 18 x 3
    with pytest.raises(ValueError, match=r"1 tile.* for world=3 ranks: every rank needs a tile"):
        grid_shards(100, 3, GRID)  # empty shards, which fused_head refuses on one rank alone
    assert grid_shards(100, 3, 32) == [(0, 64), (64, 32), (96, 4)]
    with pytest.raises(ValueError, match="grid must be an int >= 1, got 0"):
        grid_shards(V, 2, 0)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("backend", "dtype"), CONFIGS, ids=lambda c: str(c).split(".")[-1])
def test_every_degree_gives_the_one_process_bits(
    backend: str, dtype: torch.dtype, ranks: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    want = single[f"{backend}-{dtype}"]
    for deg in (1, 2, 4):
        for r, got in enumerate(ranks):
            res = got[f"{backend}-{dtype}-{deg}"]
            for i, name in enumerate([*FLOATS[:-1], *["gathered"] * K]):
                a, b = res["values"][i], want["values"][i]
                assert torch.equal(a, b), (
                    f"degree {deg}, rank {r}, {name}: max diff {float((a - b).abs().max()):.3g}"
                )
            # gradients: correct, not necessarily the same bits (the backward's tiles differ)
            scale = float(want["d_hidden"].abs().max())
            err = float((res["d_hidden"] - want["d_hidden"]).abs().max())
            assert err <= 1e-2 * scale if dtype == torch.bfloat16 else err <= 2e-3 * scale
            lo, rows = grid_shards(V, deg, GRID)[r % deg]
            dw = want["d_weight"][lo : lo + rows].float()
            err = float((res["d_weight"].float() - dw).abs().max())
            assert err <= 1e-2 * float(dw.abs().max() + 1e-30)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("backend", "dtype"), CONFIGS, ids=lambda c: str(c).split(".")[-1])
def test_off_the_grid_the_results_stay_close(
    backend: str, dtype: torch.dtype, ranks: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    want = single[f"{backend}-{dtype}"]["values"]
    for got in ranks:
        res = got[f"{backend}-{dtype}-off"]["values"]
        err = float((res - want).abs().max())
        assert err <= 4e-6 * max(1.0, float(want.abs().max())), err
