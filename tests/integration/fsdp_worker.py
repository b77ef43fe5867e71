"""Worker processes for the FSDP2 tests: each rank checks its sharded run against the unsharded one.

Every rank builds the same model, keeps an unsharded copy, shards the original with
``fully_shard``, runs its own batch, and compares outputs and gradients with the unsharded copy
run on both ranks' batches (FSDP2 averages gradients over ranks). Failures raise in the worker,
and ``torch.multiprocessing.spawn`` re-raises them in the test with the traceback.
"""

from __future__ import annotations

import copy
import datetime
import faulthandler
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from integration_helpers import BACKEND, tiny_causal_lm
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from fusedhead import FusedLMHead
from fusedhead.api import FusedHeadOutput

H, V = 16, 37  # V odd: FSDP2 pads the uneven shards (19 + 18 rows)


class TiedLM(nn.Module):
    """Embedding, one hidden layer and a FusedLMHead sharing the embedding's Parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.head = FusedLMHead(self.embed.weight, {"backend": BACKEND})

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, temperature: Any) -> FusedHeadOutput:
        return self.head(torch.tanh(self.body(self.embed(ids))), labels, temperature=temperature)


def _batch(rank: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, vocab, (2, 9), generator=g)
    labels = torch.randint(0, vocab, (2, 9), generator=g)
    labels[1, 3] = -100
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0  # left padding in the second row
    return {
        "ids": ids,
        "labels": labels,
        "mask": mask,
        "hidden": torch.randn(2, 9, H, generator=g),
        "temperature": torch.rand(2, 1, generator=g) + 0.5,
        "g_lp": torch.randn(2, 9, generator=g),
        "g_ent": torch.randn(2, 9, generator=g),
    }


def _loss(out: FusedHeadOutput, b: dict[str, torch.Tensor]) -> torch.Tensor:
    assert out.entropy is not None
    return (out.log_probs * b["g_lp"]).sum() + (out.entropy * b["g_ent"]).sum()


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _check(
    what: str,
    make: Callable[[], nn.Module],
    shard: Callable[[nn.Module], None],
    run: Callable[[nn.Module, dict[str, torch.Tensor]], FusedHeadOutput],
    rank: int,
    world: int,
    vocab: int,
) -> None:
    model = make()
    reference = copy.deepcopy(model)
    shard(model)
    assert isinstance(model, FSDPModule), f"{what}: the root must be sharded"
    batches = [_batch(r, vocab) for r in range(world)]

    out = run(model, batches[rank])
    _loss(out, batches[rank]).backward()

    ref_outs = [run(reference, b) for b in batches]
    (sum(_loss(o, b) for o, b in zip(ref_outs, batches)) / world).backward()

    torch.testing.assert_close(
        out.log_probs, ref_outs[rank].log_probs, msg=lambda m: f"{what} log_probs: {m}"
    )
    torch.testing.assert_close(
        out.entropy, ref_outs[rank].entropy, msg=lambda m: f"{what} entropy: {m}"
    )
    ref_params = dict(reference.named_parameters())
    names = []
    for name, param in model.named_parameters():
        assert type(param).__name__ == "DTensor", f"{what}: {name} is not sharded outside forward"
        want = ref_params[name].grad
        got = _full(param.grad)
        assert want is not None and got is not None, f"{what}: {name} got no gradient"
        torch.testing.assert_close(
            got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{what} grad {n}: {m}"
        )
        names.append(name)
    assert names, what


def _head_only(rank: int, world: int) -> None:
    def make() -> nn.Module:
        torch.manual_seed(1)
        return FusedLMHead.from_linear(
            nn.Linear(H, V, bias=False), {"backend": BACKEND, "softcap": 4.0}
        )

    hidden_grads: list[torch.Tensor] = []

    def run(head: nn.Module, b: dict[str, torch.Tensor]) -> FusedHeadOutput:
        h = b["hidden"].clone().requires_grad_(True)
        hidden_grads.append(h)
        return head(h, b["labels"], temperature=b["temperature"])  # type: ignore[no-any-return]

    _check("FusedLMHead alone", make, lambda m: fully_shard(m), run, rank, world, V)
    got, want = hidden_grads[0].grad, hidden_grads[1 + rank].grad
    assert got is not None and want is not None
    torch.testing.assert_close(
        got, want * world, msg=lambda m: f"hidden grad: {m}"
    )  # ref loss is /world


def _tied(rank: int, world: int) -> None:
    def shard(m: nn.Module) -> None:
        fully_shard(m.body)
        fully_shard(m)  # the root holds the shared embedding/head Parameter once

    def run(m: nn.Module, b: dict[str, torch.Tensor]) -> FusedHeadOutput:
        return m(b["ids"], b["labels"], b["temperature"])  # type: ignore[no-any-return]

    _check("tied embeddings", TiedLM, shard, run, rank, world, V)


def _transformers(rank: int, world: int, kind: str, shard_head: bool) -> None:
    from fusedhead.integrations.transformers import causal_lm_logprobs

    def make() -> nn.Module:
        return tiny_causal_lm(kind).train()

    def shard(m: nn.Module) -> None:
        for layer in m.model.layers:
            fully_shard(layer)
        if shard_head:
            fully_shard(m.lm_head)
        fully_shard(m)

    def run(m: nn.Module, b: dict[str, torch.Tensor]) -> FusedHeadOutput:
        return causal_lm_logprobs(
            m, b["ids"], b["mask"], temperature=b["temperature"], config={"backend": BACKEND}
        )

    what = f"transformers {kind}" + (" (lm_head sharded alone)" if shard_head else "")
    _check(what, make, shard, run, rank, world, 503)


class BodyAndHead(nn.Module):
    """A body whose forward gives the hidden states, and an LM head the trainer calls after it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.body = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(x))


def _policy_loss(rank: int, world: int) -> None:
    """``lm_head_policy_loss`` after the model's forward, the LM head sharded on its own (FSDP2
    reshards it after its call): the loss comes back as a ``PolicyLossOutput`` from the head's
    hooked call, and every parameter's gradient must still be the unsharded model's."""
    from fusedhead.integrations.lm_head import lm_head_policy_loss

    model = BodyAndHead()
    reference = copy.deepcopy(model)
    fully_shard(model.lm_head)
    fully_shard(model)
    batches = [_batch(r, V) for r in range(world)]

    def run(m: nn.Module, b: dict[str, torch.Tensor]) -> Any:
        g = torch.Generator().manual_seed(7)
        old = -3.0 + 0.1 * torch.randn(2, 9, generator=g)
        return lm_head_policy_loss(
            m.lm_head, m(b["hidden"]), b["labels"], old_log_probs=old, advantages=b["g_lp"],
            temperature=0.8, entropy_coef=0.01, head={"backend": BACKEND},
        )  # fmt: skip

    out = run(model, batches[rank])
    out.loss.backward()
    refs = [run(reference, b) for b in batches]
    (sum(o.loss for o in refs) / world).backward()
    torch.testing.assert_close(out.log_probs, refs[rank].log_probs)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert type(param).__name__ == "DTensor", f"{name} is not sharded outside forward"
        got, want = _full(param.grad), ref_params[name].grad
        assert got is not None and want is not None, f"{name} got no gradient"
        torch.testing.assert_close(
            got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


SCENARIOS: dict[str, Callable[[int, int], None]] = {
    "policy_loss": _policy_loss,
    "head_only": _head_only,
    "tied": _tied,
    "llama": lambda r, w: _transformers(r, w, "llama", shard_head=False),
    "llama_head_sharded": lambda r, w: _transformers(r, w, "llama", shard_head=True),
    "gemma2_tied_softcap": lambda r, w: _transformers(r, w, "gemma2", shard_head=False),
}


def worker(rank: int, world: int, init_method: str, scenarios: list[str], log_dir: str) -> None:
    """One rank: a gloo process group (rendezvous at ``init_method``), then each scenario in order.

    Progress and, on a crash, every thread's stack go to ``log_dir/rank{rank}.log``.
    """
    log = open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1)  # noqa: SIM115
    faulthandler.enable(log, all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    log.write("process group up\n")
    try:
        for name in scenarios:
            log.write(f"{name}: start\n")
            SCENARIOS[name](rank, world)
            log.write(f"{name}: passed\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
        log.write("process group destroyed\n")
    # Every scenario passed. Leave without the interpreter's teardown: on CI a rank once aborted
    # (SIGABRT, no Python frame) in a native destructor after the group was destroyed, failing a
    # run whose checks had all passed. A failure above still raises through torch's spawn wrapper.
    log.close()
    os._exit(0)
