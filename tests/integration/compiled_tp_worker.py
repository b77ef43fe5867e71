"""Worker for the compiled vocab-parallel test: each gloo rank runs one ``fused_head`` step on its
shard of the weight, eagerly and under ``torch.compile(fullgraph=True)``, and returns both."""

from __future__ import annotations

from typing import Any

import torch

N, H, V = 24, 16, 40
WORLD = 2
SHARDS = [(0, 17), (17, 40)]  # uneven, as a real vocabulary split need not be even


def run(backend: str, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from fusedhead import fused_head

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / 2
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    start, stop = SHARDS[rank]
    group = dist.group.WORLD

    def step(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = fused_head(
            h, w, labels, backend=backend, temperature=0.7, process_group=group,
            vocab_start=start, vocab_size=V,
        )  # fmt: skip
        return (out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()

    result: dict[str, Any] = {}
    for name, fn in (
        ("eager", step),
        ("compiled", torch.compile(step, backend="aot_eager", fullgraph=True)),
    ):
        h = hidden.clone().requires_grad_()
        w = weight[start:stop].clone().requires_grad_()
        loss = fn(h, w)
        loss.backward()
        result[name] = {"loss": loss.detach(), "d_hidden": h.grad, "d_weight": w.grad}
    return result
