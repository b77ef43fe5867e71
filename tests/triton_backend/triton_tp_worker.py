"""Worker for the vocab-parallel tests: one gloo rank runs every case on its vocabulary shard, in
each of ``DTYPES`` (the interpreter's dots are right in fp32 and fp16, not bf16)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fusedhead.protocol import call_backend

N, H, V = 29, 40, 192
BAD_ROW = 4  # its label is past the vocabulary: NaN log-prob on every rank
IGNORE = -100
#: name -> shard bounds for 2 ranks, reduce_hidden_grad, and call keywords
CASES: dict[str, dict[str, Any]] = {
    "equal": {"bounds": [0, 96, 192], "reduce": True, "kwargs": {}},
    "uneven_partial_dh": {"bounds": [0, 70, 192], "reduce": False, "kwargs": {}},
    "uneven_softcap_token_t": {
        "bounds": [0, 130, 192],
        "reduce": True,
        "kwargs": {"softcap": 2.0, "per_token": True},
    },
    "no_entropy": {"bounds": [0, 96, 192], "reduce": True, "kwargs": {"entropy": False}},
}
#: The dtypes every case runs in (the full inputs are made in fp32, then rounded to each).
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
TILES = {"block_m": 32, "block_n": 64, "block_k": 32, "backward_block_mib": 1e-3}


def full_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = IGNORE
    labels[BAD_ROW] = V + 3
    return {
        "hidden": torch.randn(N, H, generator=g),
        "weight": torch.randn(V, H, generator=g) / H**0.5,
        "labels": labels,
        "temps": torch.rand(N, generator=g) + 0.5,
        "g_lp": torch.randn(N, generator=g),
        "g_ent": torch.randn(N, generator=g),
    }


def run_case(
    x: dict[str, torch.Tensor],
    lo: int,
    hi: int,
    reduce: bool,
    group: Any,
    dtype: torch.dtype = torch.float32,
    *,
    softcap: float | None = None,
    per_token: bool = False,
    entropy: bool = True,
    memory: str = "low",
) -> dict[str, Any]:
    """Forward + backward on rows [lo, hi) of the weight in ``dtype``; outputs and both
    gradients."""
    from fusedhead_triton import TritonBackend, TritonOptions

    h = x["hidden"].to(dtype, copy=True).requires_grad_()
    w = x["weight"][lo:hi].to(dtype, copy=True).requires_grad_()
    temp = x["temps"] if per_token else 0.7
    lp, ent = call_backend(TritonBackend(TritonOptions(**TILES, memory=memory)),
        h, w, x["labels"], temperature=temp, ignore_index=IGNORE, return_entropy=entropy,
        process_group=group, vocab_start=lo, vocab_size=V, reduce_hidden_grad=reduce,
        softcap=softcap,
    )  # fmt: skip
    return backward_outputs(lp, ent, h, w, x)


def backward_outputs(
    lp: torch.Tensor, ent: torch.Tensor | None, h: torch.Tensor, w: torch.Tensor,
    x: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """The loss every run differentiates (upstream gradients ``x["g_lp"]``, ``x["g_ent"]``; an
    ignored row's NaN skipped), then the outputs and both gradients."""
    loss = (lp * x["g_lp"].to(lp.dtype)).nansum()
    if ent is not None:
        loss = loss + (ent * x["g_ent"].to(ent.dtype)).sum()
    loss.backward()
    return {
        "log_probs": lp.detach(),
        "entropy": None if ent is None else ent.detach(),
        "d_hidden": h.grad,
        "d_weight": w.grad,
    }


def double_backward_error(x: dict[str, torch.Tensor], lo: int, hi: int, group: Any) -> str:
    """The error a gradient penalty through the sharded call raises ('' if none; it used to
    return a detached first-order gradient, so the penalty vanished)."""
    from fusedhead_triton import TritonBackend, TritonOptions

    h = x["hidden"].clone().requires_grad_()
    w = x["weight"][lo:hi].clone().requires_grad_()
    lp, _ = call_backend(TritonBackend(TritonOptions(**TILES)),
        h, w, x["labels"], temperature=0.7, ignore_index=IGNORE, return_entropy=False,
        process_group=group, vocab_start=lo, vocab_size=V, reduce_hidden_grad=True,
    )  # fmt: skip
    try:
        (g,) = torch.autograd.grad((lp * x["g_lp"]).nansum(), h, create_graph=True)
        (g.pow(2).sum() + lp.nansum()).backward()
    except RuntimeError as e:
        return str(e)
    return ""


def worker(rank: int, world: int, port: int, out: str) -> None:
    """mp.spawn target: join the gloo group, run every case on this rank's shard, save."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        x = full_inputs()
        results: dict[str, Any] = {}
        for d, dtype in DTYPES.items():
            results[d] = {}
            for name, case in CASES.items():
                lo, hi = case["bounds"][rank], case["bounds"][rank + 1]
                results[d][name] = run_case(
                    x, lo, hi, case["reduce"], dist.group.WORLD, dtype, **case["kwargs"]
                )
        lo, hi = CASES["equal"]["bounds"][rank], CASES["equal"]["bounds"][rank + 1]
        results["double_backward"] = double_backward_error(x, lo, hi, dist.group.WORLD)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.barrier()  # gloo can abort a process torn down while a peer still talks
        dist.destroy_process_group()
