"""Worker for the rank-agreement tests: two gloo ranks call ``fused_head`` on vocabulary shards,
one rank's call differing from the other's in one way per case, and record what each raised;
after every case both ranks make one good call, which must still be in step."""

from __future__ import annotations

from typing import Any

import torch

N, H, V = 6, 8, 16
WORLD = 2


def _case_args(name: str, rank: int, base: dict[str, Any]) -> dict[str, Any]:
    """The call of ``rank`` in case ``name``: rank 1 differs from rank 0 (or both fail alike)."""
    kw = dict(base)
    other = rank == 1
    if name == "labels_differ" and other:
        kw["labels"] = kw["labels"].roll(1)
    elif name == "label_out_of_range_on_every_rank" or (
        name == "label_out_of_range_on_one_rank" and other
    ):
        kw["labels"] = kw["labels"].clone()
        kw["labels"][2] = V + 3
    elif name == "rows_differ" and other:
        kw["hidden"], kw["labels"] = kw["hidden"][:4], kw["labels"][:4]
    elif name == "hidden_differs" and other:
        kw["hidden"] = kw["hidden"].clone()
        kw["hidden"][3, 5] += 1.0
    elif name == "temperature_differs" and other:
        kw["temperature"] = 1.3
    elif name == "token_temperature_differs":
        t = torch.full((N,), 0.7)
        if other:
            t[4] = 0.9
        kw["temperature"] = t
    elif name == "bad_token_temperature_on_one_rank":
        t = torch.full((N,), 0.7)
        if other:
            t[1] = -1.0
        kw["temperature"] = t
    elif name == "entropy_on_one_rank" and other:
        kw["return_entropy"] = False
    elif name == "grad_on_one_rank" and other:
        kw["hidden"] = kw["hidden"].clone().requires_grad_(True)
    elif name == "ignored_row_differs":  # an ignored row reaches nothing, so it may differ
        kw["labels"] = kw["labels"].clone()
        kw["labels"][3] = -100
        if other:
            kw["hidden"] = kw["hidden"].clone()
            kw["hidden"][3] = float("nan")
    elif name == "rows_swapped" and other:  # the same values, in another order
        kw["hidden"] = kw["hidden"][[2, 1, 0, 3, 4, 5]]
    elif name == "elements_swapped" and other:
        kw["hidden"] = kw["hidden"].clone()
        kw["hidden"][3, [1, 5]] = kw["hidden"][3, [5, 1]]
    elif name == "token_temperature_permuted":
        t = torch.linspace(0.5, 1.5, N)
        kw["temperature"] = t.flip(0) if other else t
    elif name == "token_temperature_differs_at_an_ignored_row":
        kw["labels"] = kw["labels"].clone()
        kw["labels"][1] = -100
        t = torch.full((N,), 0.7)
        if other:
            t[1] = 3.0
        kw["temperature"] = t
    elif name == "refused_on_one_rank" and other:
        kw["hidden"] = kw["hidden"].double()  # fp64 hidden: refused by name on this rank
    # refused before the head runs (the entry point's own checks, the backend's resolution)
    elif name == "temperature_none_on_one_rank" and other:
        kw["temperature"] = None
    elif name == "check_labels_not_bool_on_one_rank" and other:
        kw["check_labels"] = 1
    elif name == "unknown_backend_on_one_rank" and other:
        kw["backend"] = "no-such-backend"
    elif name == "unknown_option_on_one_rank" and other:
        kw["options"] = {"no_such_option": 1}
    elif name == "other_backend_on_one_rank" and other:
        kw["backend"] = OTHER_BACKEND
    elif name == "negative_zero_on_one_rank":  # -0.0 == +0.0: the same call
        kw["hidden"] = kw["hidden"].clone()
        kw["hidden"][2, 3] = -0.0 if other else 0.0
    elif name == "reduce_differs_without_a_gradient" and other:
        kw["reduce_hidden_grad"] = False
    elif name == "empty_batch_with_gather_ids":
        kw["hidden"], kw["labels"] = kw["hidden"][:0], kw["labels"][:0]
        kw["gather_ids"] = torch.zeros(0, 2, dtype=torch.long)
    return kw


#: The backend rank 1 runs in ``other_backend_on_one_rank``, by the backend under test.
OTHER = {"torch": "triton", "triton": "torch"}
OTHER_BACKEND = ""


CASES = (
    "agree",
    "labels_differ",
    "label_out_of_range_on_one_rank",
    "label_out_of_range_on_every_rank",
    "rows_differ",
    "hidden_differs",
    "temperature_differs",
    "token_temperature_differs",
    "bad_token_temperature_on_one_rank",
    "entropy_on_one_rank",
    "grad_on_one_rank",
    "refused_on_one_rank",
    "ignored_row_differs",
    "rows_swapped",
    "elements_swapped",
    "token_temperature_permuted",
    "token_temperature_differs_at_an_ignored_row",
    "module_bias_refused_on_one_rank",
    "temperature_none_on_one_rank",
    "check_labels_not_bool_on_one_rank",
    "unknown_backend_on_one_rank",
    "unknown_option_on_one_rank",
    "other_backend_on_one_rank",
    "empty_batch_with_gather_ids",
    "negative_zero_on_one_rank",
    "reduce_differs_without_a_gradient",
)


def run(backend: str, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from fusedhead import fused_head
    from fusedhead.module import FusedLMHead

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / 3
    labels = torch.randint(0, V, (N,), generator=g)
    shard = weight[rank * (V // WORLD) : (rank + 1) * (V // WORLD)]
    base = {"hidden": hidden, "labels": labels}
    results: dict[str, Any] = {}
    other = rank == 1
    global OTHER_BACKEND
    OTHER_BACKEND = OTHER[backend]
    for name in CASES:
        kw = _case_args(name, rank, base)
        h, y = kw.pop("hidden"), kw.pop("labels")
        named = kw.pop("backend", backend)
        try:
            if name == "module_bias_refused_on_one_rank":  # a bias replaced after it was built
                bias = torch.nn.Parameter(torch.zeros(shard.shape[0]))
                m = FusedLMHead(torch.nn.Parameter(shard.clone()), {"backend": backend}, bias=bias)
                if other:
                    m.bias = torch.nn.Parameter(torch.zeros(shard.shape[0] + 1))
                out = m(h, y, process_group=dist.group.WORLD)
            else:
                out = fused_head(h, shard, y, backend=named, process_group=dist.group.WORLD, **kw)
            results[name] = ("ok", out.log_probs.detach().clone())
        except Exception as exc:  # what each rank raised, compared across ranks by the test
            results[name] = (type(exc).__name__, str(exc))
        good = fused_head(hidden, shard, labels, backend=backend, process_group=dist.group.WORLD)
        results[f"{name}/then"] = good.log_probs.clone()
    results["one_process"] = fused_head(hidden, weight, labels, backend=backend).log_probs
    return results
