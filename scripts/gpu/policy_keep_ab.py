"""EXPERIMENT (issue 31): the triton policy loss's kept-offset store, A/B in one process.

    python scripts/gpu/policy_keep_ab.py OUT_DIR [--n 8192]

Variants of ``fusedhead_triton.policy.KEEP_STORE`` (early, split): the store at the epilogue's
end or right after ``d``; one 128 x 256 TMA store or two column halves. Interleaved rounds, each
variant's median fwd+bwd ms of a few steps; every variant's loss and gradients bitwise against
the first's. Writes OUT_DIR/policy_keep_ab.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from policy_loss_bench import build, make_inputs, timed

VARIANTS = [(False, 1), (True, 1), (False, 2), (True, 2)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    import fusedhead_triton.policy as tp

    dev = torch.device("cuda")
    x = make_inputs(a.n, 4096, 151936, dev, torch.bfloat16)
    fn = build("fused:triton", x)
    h = x["hidden"].detach().clone().requires_grad_()
    w = x["weight"].detach().clone().requires_grad_()
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    res: dict[str, Any] = {"n": a.n, "rounds": [], "bitwise": {}}
    first: tuple[torch.Tensor, ...] | None = None
    for v in VARIANTS:
        tp.KEEP_STORE = v
        hh = x["hidden"].detach().clone().requires_grad_()
        ww = x["weight"].detach().clone().requires_grad_()
        loss = fn(hh, ww)
        loss.backward()
        got = (loss.detach(), hh.grad, ww.grad)
        if first is None:
            first = got
        res["bitwise"][str(v)] = all(torch.equal(g, f) for g, f in zip(got, first, strict=True))
    print(json.dumps(res["bitwise"]), flush=True)
    hid, wt = x["hidden"], x["weight"]
    for r in range(a.rounds):
        row: dict[str, float] = {"unit_ms": statistics.median(timed(lambda: hid @ wt.T, 5, dev))}
        for v in VARIANTS:
            tp.KEEP_STORE = v
            row[str(v)] = statistics.median(timed(lambda: fn(h, w).backward(), 5, dev))
        res["rounds"].append(row)
        print(json.dumps({"round": r, **{k: round(val, 2) for k, val in row.items()}}), flush=True)
    res["median_ms"] = {
        str(v): statistics.median(rr[str(v)] for rr in res["rounds"]) for v in VARIANTS
    }
    print(json.dumps(res["median_ms"]), flush=True)
    (a.out / "policy_keep_ab.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
