"""One rank of the vocab-parallel check of the outputs past (log_probs, entropy), started by ``mp.spawn``.

Every rank builds the same problem from a seed, keeps its shard ``[start, stop)`` of the weight,
calls ``fused_head`` over gloo with ``process_group`` (lse, sum_p2, gather, top-k and argmax at
once) and saves outputs and gradients. A rank whose shard is empty calls the backend itself (the
core refuses an empty weight; a backend must still take part in the collectives).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

N, H, V, K = 48, 16, 130, 9
#: name -> shard boundaries per world size (rank r holds ``[b[r], b[r + 1])``, or with
#: ``reversed`` the shard ``world - 1 - r``), whether the hidden gradient is all-reduced, the
#: inputs (``random``, or ``ties``: integer logits, equal values inside and across shards) and k.
CASES: dict[str, dict[str, Any]] = {
    "uneven": {"bounds": {2: [0, 17, 130], 3: [0, 70, 71, 130]}, "reduce": True},
    "one-row-shard": {"bounds": {2: [0, 1, 130], 3: [0, 50, 51, 130]}, "reduce": True},
    "partial-dh": {"bounds": {2: [0, 64, 130], 3: [0, 40, 90, 130]}, "reduce": False},
    "ties": {"bounds": {2: [0, 17, 130], 3: [0, 30, 31, 130]}, "reduce": True, "inputs": "ties"},
    "ties-reversed-shards": {
        "bounds": {2: [0, 60, 130], 3: [0, 20, 100, 130]},
        "reduce": False,
        "inputs": "ties",
        "reversed": True,
        "top_k": 40,  # more than a block (24) and than some shards: padded lists
    },
    "empty-shard": {
        "bounds": {2: [0, 0, 130], 3: [0, 65, 65, 130]},
        "reduce": True,
        "inputs": "ties",
        "top_k": 1,
    },
}
OPTIONS = {"chunk_rows": 20, "block_vocab": 24}
TOP_K = 7  # more than the one-row shard holds


def inputs(kind: str = "random") -> dict[str, torch.Tensor]:
    """The full problem; ``ties``: small integers, so every logit is exact and many are equal."""
    g = torch.Generator().manual_seed(7)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::6] = -100
    ids = torch.randint(0, V, (N, K), generator=g)
    ids[:, 0] = labels.clamp(min=0)
    ids[:, -1] = -100
    if kind == "ties":
        hidden = torch.randint(-1, 2, (N, H), generator=g).float()
        weight = torch.randint(-1, 2, (V, H), generator=g).float()
    else:
        hidden = torch.randn(N, H, generator=g)
        weight = torch.randn(V, H, generator=g) * 0.7
    return {
        "hidden": hidden,
        "weight": weight,
        "labels": labels,
        "ids": ids,
        "temperature": torch.linspace(0.5, 2.0, N),
        "grads": torch.randn(4, N, generator=g),
        "grad_gather": torch.randn(N, K, generator=g),
        "grad_topk": torch.randn(N, 64, generator=g),
    }


def _call(
    h: torch.Tensor, w: torch.Tensor, x: dict[str, torch.Tensor], k: int, kw: dict[str, Any]
) -> Any:
    """Every output at once: through ``fused_head``, or the backend itself for an empty shard."""
    args: dict[str, Any] = {"temperature": x["temperature"], "softcap": 3.0, "top_k": k}
    if w.shape[0] > 0:
        from fusedhead import fused_head

        return fused_head(
            h,
            w,
            x["labels"],
            gather_ids=x["ids"],
            return_lse=True,
            return_sum_p2=True,
            return_argmax=True,
            options=OPTIONS,
            **args,
            **kw,
        )
    from fusedhead.protocol import HeadCall
    from fusedhead_torch.backend import TorchBackend
    from fusedhead_torch.options import TorchOptions

    call = HeadCall.make(
        h,
        w,
        x["labels"],
        extras=frozenset({"lse", "sum_p2", "argmax"}),
        gather_ids=x["ids"],
        **args,
        **kw,
    )
    if call.process_group is not None:  # the ranks' agreement that fused_head makes on the others
        from fusedhead import rank_agreement

        rank_agreement.agree(call, h.dtype, torch.is_grad_enabled(), None, "torch")
    return TorchBackend(TorchOptions(**OPTIONS)).forward(call)


def run(
    x: dict[str, torch.Tensor], start: int, stop: int, reduce: bool, group: Any, k: int = TOP_K
) -> dict[str, Any]:
    """The call on rows ``[start, stop)`` of the weight; outputs and gradients."""
    h = x["hidden"].clone().requires_grad_(True)
    w = x["weight"][start:stop].clone().requires_grad_(True)
    kw: dict[str, Any] = {}
    if group is not None:
        kw = {
            "process_group": group,
            "vocab_start": start,
            "vocab_size": V,
            "reduce_hidden_grad": reduce,
        }
    out = _call(h, w, x, k, kw)
    g = x["grads"]
    loss = (out.log_probs * g[0]).sum() + (out.entropy * g[1]).sum() + (out.lse * g[2]).sum()
    loss = loss + (out.sum_p2 * g[3]).sum() + (out.gathered * x["grad_gather"]).sum()
    loss = loss + (out.topk_log_probs * x["grad_topk"][:, :k]).sum()
    loss.backward()
    fields = ("log_probs", "entropy", "lse", "sum_p2", "gathered", "topk_log_probs")
    result = {f: getattr(out, f).detach() for f in fields}
    result["topk_ids"], result["argmax"] = out.topk_ids, out.argmax
    result["grad_hidden"], result["grad_weight"] = h.grad, w.grad
    return result


def shard(case: dict[str, Any], world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s shard in ``case``."""
    b = case["bounds"][world]
    r = world - 1 - rank if case.get("reversed") else rank
    return b[r], b[r + 1]


#: The row whose NaN poisons every row's logits in ``nan_column_ids`` (in the last shard).
NAN_ROW = 100


def nan_column_ids(start: int, stop: int, group: Any) -> dict[str, torch.Tensor]:
    """Argmax and top-k ids where weight row ``NAN_ROW`` is NaN: every scored row's logits hold a
    NaN, so each has no most likely id (-1) in one process, and must have none at any degree
    (gloo's MAX all-reduce of the row max may drop the NaN)."""
    from fusedhead import fused_head

    x = inputs()
    weight = x["weight"].clone()
    weight[NAN_ROW] = float("nan")
    kw: dict[str, Any] = {}
    if group is not None:
        kw = {"process_group": group, "vocab_start": start, "vocab_size": V}
    with torch.no_grad():
        out = fused_head(
            x["hidden"], weight[start:stop], x["labels"], top_k=2, return_argmax=True, **kw
        )
    return {"argmax": out.argmax, "topk_ids": out.topk_ids, "log_probs": out.log_probs}


def worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        results = {}
        for name, case in CASES.items():
            x = inputs(case.get("inputs", "random"))
            start, stop = shard(case, world, rank)
            k = case.get("top_k", TOP_K)
            results[name] = run(x, start, stop, case["reduce"], dist.group.WORLD, k)
        start, stop = shard(CASES["uneven"], world, rank)
        results["nan-column"] = nan_column_ids(start, stop, dist.group.WORLD)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
