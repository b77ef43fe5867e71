"""Vocab-parallel property: two processes each hold a vocabulary shard (gloo on CPU, NCCL on 2 GPUs).

Each spawned rank resolves the backend by name, computes forward and backward on its shard with
``process_group``, and saves what it got; the parent compares every rank with the single-process
float64 reference: full log_probs and entropy on every rank, the weight gradient of the rank's
shard, and the hidden gradient (summed over ranks with ``reduce_hidden_grad=True``; the rank's own
partial ``(dz / T)[:, shard] @ W[shard]`` with False).
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusedhead.testing.inputs import FLAT, TEMPERATURE, make_case, upstream
from fusedhead.testing.measure import gradient_terms, reference, zmax
from fusedhead.testing.outcome import KIT_EXCEPTIONS, NotRun, PropertyFailure, exception_chain
from fusedhead.testing.target import DTYPES, Target
from fusedhead.testing.tolerances import assert_close

WORLD = 2
TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Shards:
    """A split of the vocabulary between the two ranks and whether to pass vocab_start explicitly."""

    name: str
    sizes: tuple[int, int]
    explicit: bool

    def start(self, rank: int) -> int:
        return sum(self.sizes[:rank])


def _layouts(target: Target) -> tuple[tuple[int, int, int], list[Shards]]:
    n, h, v = target.sizes.small
    shards = [
        Shards("equal shards (default vocab_start/vocab_size)", (v // 2, v // 2), explicit=False)
    ]
    if target.caps.uneven_shards:
        shards.append(Shards("uneven shards", (v // 2 + 37, v // 2 - 37), explicit=True))
    return (n, h, v), shards


def _in_process_class(name: str) -> str | None:
    """``module:qualname`` of an in-process registered backend, for the spawned ranks to register it."""
    from fusedhead import registry

    cand = registry.find(name)
    return cand.value if cand.cls is not None else None


def _worker(rank: int, spec: dict[str, Any]) -> None:
    """One rank: set up the group, run every case, write results (or the error) under spec['out']."""
    out = Path(spec["out"])
    stage = "setup"
    try:
        import torch.distributed as dist

        from fusedhead import registry
        from fusedhead.testing.target import Target

        if spec["device"] == "cpu":
            torch.set_num_threads(1)
            device = "cpu"
        else:
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        if spec["class"]:
            module, qualname = spec["class"].split(":")
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            registry.register_backend(spec["backend"], obj, replace=True)
        dist.init_process_group(
            spec["dist_backend"],
            init_method=spec["init"],
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=120),
        )
        target = Target.resolve(spec["backend"], spec["options"], device, spec["dtype"])
        temp = target.allowed_temperature(TEMPERATURE)  # within the declared minimum
        stage = "run"
        n, h, v = spec["shape"]
        case = make_case(n, h, v, scale=FLAT, seed=21).to(target.device, target.dtype)
        g_lp, g_ent = upstream(case.labels.shape, seed=21)
        results = {}
        for i, (_name, sizes, explicit) in enumerate(spec["shards"]):
            start = sum(sizes[:rank])
            for reduce in (True, False):
                hidden = case.hidden.detach().clone().requires_grad_(True)
                weight = (
                    case.weight[start : start + sizes[rank]].detach().clone().requires_grad_(True)
                )
                kw: dict[str, Any] = {"vocab_start": start, "vocab_size": v} if explicit else {}
                lp, ent = target(
                    hidden,
                    weight,
                    case.labels,
                    temperature=temp,
                    process_group=dist.group.WORLD,
                    reduce_hidden_grad=reduce,
                    **kw,
                )
                loss = (lp.double() * g_lp.to(lp.device, torch.float64)).sum()
                loss = loss + (ent.double() * g_ent.to(ent.device, torch.float64)).sum()
                torch.autograd.backward([loss])
                results[f"{i}-{reduce}"] = {
                    "log_probs": lp.detach().cpu(),
                    "entropy": ent.detach().cpu(),
                    "grad_hidden": None if hidden.grad is None else hidden.grad.cpu(),
                    "grad_weight": None if weight.grad is None else weight.grad.cpu(),
                }
        torch.save(results, out / f"rank{rank}.pt")
        dist.barrier()  # gloo can abort a process torn down while a peer still talks
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which decides fail or not run
        last = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        kit = next((e for e in exception_chain(exc) if isinstance(e, KIT_EXCEPTIONS)), None)
        report = {"stage": stage, "error": last, "traceback": traceback.format_exc()}
        if kit is not None:  # the rank's code raises neither: the backend did
            report["kit_exception"] = f"{type(kit).__name__}({kit})"
        (out / f"error{rank}.json").write_text(json.dumps(report))
        raise


def _spawn(spec: dict[str, Any]) -> None:
    import torch.multiprocessing as mp

    try:
        ctx = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _worker, args=(spec,), nprocs=WORLD, join=False, start_method="spawn"
        )
    except Exception as exc:
        raise NotRun(
            f"could not spawn {WORLD} processes here: {type(exc).__name__}: {exc}"
        ) from exc
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                raise PropertyFailure(
                    f"the {WORLD} ranks did not finish within {TIMEOUT_S:.0f} s (hang in a collective?)"
                )
    except PropertyFailure:
        raise
    except Exception as exc:
        errors = [json.loads(p.read_text()) for p in sorted(Path(spec["out"]).glob("error*.json"))]
        _blame_kit_exceptions(spec["backend"], errors)
        if errors and all(e["stage"] == "setup" for e in errors):
            raise NotRun(
                f"could not set up {spec['dist_backend']} with {WORLD} processes: {errors[0]['error']}"
            ) from exc
        if errors:
            run_errors = [e for e in errors if e["stage"] == "run"]
            raise PropertyFailure(f"a rank raised {(run_errors or errors)[0]['error']}") from exc
        raise NotRun(
            f"the spawned processes failed before running: {type(exc).__name__}: {exc}"
        ) from exc


def _blame_kit_exceptions(backend: str, errors: list[dict[str, Any]]) -> None:
    """A rank whose backend raised the kit's own NotRun or PropertyFailure fails the property
    (whatever the stage): a backend never reports the kit's verdicts itself."""
    for error in errors:
        if error.get("kit_exception"):
            raise PropertyFailure(
                f"the backend {backend!r} raised the kit's own {error['kit_exception']} in a "
                f"rank ({error['stage']}); a backend never raises fusedhead.testing's exceptions: "
                "only the kit decides what is not run"
            )


def vocab_parallel(target: Target) -> None:
    """If declared: 2 ranks with vocabulary shards match the single-process float64 reference."""
    if not target.caps.vocab_parallel:
        raise NotRun(f"the backend does not declare vocab_parallel on {target.device.type}")
    import torch.distributed as dist

    if not dist.is_available():
        raise NotRun("torch.distributed is not available in this torch build")
    if target.device.type == "cpu":
        dist_backend = "gloo"
    elif target.device.type == "cuda":
        if torch.cuda.device_count() < WORLD:
            raise NotRun(f"NCCL needs {WORLD} GPUs, this machine has {torch.cuda.device_count()}")
        dist_backend = "nccl"
    else:
        raise NotRun(f"no process-group backend for device type {target.device.type!r}")
    (n, h, v), shards = _layouts(target)
    with tempfile.TemporaryDirectory(prefix="fusedhead-vp-") as tmp:
        spec = {
            "backend": target.backend,
            "options": target.options,
            "class": _in_process_class(target.backend),
            "device": target.device.type,
            "dtype": target.dtype_name,
            "dist_backend": dist_backend,
            "init": "file://" + os.path.join(tmp, "rendezvous"),
            "out": tmp,
            "shape": (n, h, v),
            "shards": [(s.name, s.sizes, s.explicit) for s in shards],
        }
        _spawn(spec)
        files = [Path(tmp) / f"rank{r}.pt" for r in range(WORLD)]
        if not all(f.exists() for f in files):
            raise NotRun(
                "the spawned processes exited without running the ranks (a script that runs the kit "
                "must guard its entry with if __name__ == '__main__')"
            )
        ranks = [torch.load(f) for f in files]
    _compare(target, (n, h, v), shards, ranks)


def _compare(
    target: Target, shape: tuple[int, int, int], shards: list[Shards], ranks: list[dict[str, Any]]
) -> None:
    temp = target.allowed_temperature(TEMPERATURE)  # within the declared minimum
    n, h, v = shape
    case = make_case(n, h, v, scale=FLAT, seed=21).to(
        torch.device("cpu"), DTYPES[target.dtype_name]
    )
    g_lp, g_ent = upstream(case.labels.shape, seed=21)
    h64 = case.hidden.double()
    w64 = case.weight.double()
    # The reference applied to the logits (hidden = u = h @ W.T, weight = identity) gives dLoss/du.
    u = (h64 @ w64.T).requires_grad_(True)
    lp, ent = reference(u, torch.eye(v, dtype=torch.float64), case.labels, temperature=temp)
    assert ent is not None
    torch.autograd.backward([(lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()])
    du = u.grad
    assert du is not None
    full_dh = du @ w64
    full_dw = du.T @ h64
    terms = gradient_terms(case, temperature=temp, seed=21)
    tol = target.tolerances(h, v, zmax(case, temperature=temp))
    for i, shard in enumerate(shards):
        for reduce in (True, False):
            for rank in range(WORLD):
                lo, hi = shard.start(rank), shard.start(rank) + shard.sizes[rank]
                got = ranks[rank][f"{i}-{reduce}"]
                label = f"{shard.name} {shard.sizes}, reduce_hidden_grad={reduce}, rank {rank}"
                want_dh = full_dh if reduce else du[:, lo:hi] @ w64[lo:hi]
                mag_dh = (terms if reduce else terms[:, lo:hi]) @ (
                    w64 if reduce else w64[lo:hi]
                ).abs()
                mag_dw = terms[:, lo:hi].T @ h64.abs()
                try:
                    assert_close("log_probs", got["log_probs"], lp.detach(), tol.log_probs)
                    assert_close("entropy", got["entropy"], ent.detach(), tol.entropy)
                    what = "grad hidden" + ("" if reduce else " (this rank's partial)")
                    if got["grad_hidden"] is None:
                        raise PropertyFailure(f"{what} is None")
                    assert_close(what, got["grad_hidden"], want_dh, tol.grad, mag_dh)
                    if got["grad_weight"] is None:
                        raise PropertyFailure("grad weight shard is None")
                    assert_close(
                        "grad weight shard", got["grad_weight"], full_dw[lo:hi], tol.grad, mag_dw
                    )
                except PropertyFailure as exc:
                    raise PropertyFailure(f"N={n} H={h} V={v}, {label}: {exc}") from None


DISTRIBUTED = {"vocab_parallel": vocab_parallel}
