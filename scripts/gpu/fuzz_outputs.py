"""Random odd-shaped problems for every output of a backend, checked against float64 by the kit.

The kit's own output properties run fixed shapes; this draws (N, H, V), scales, temperatures
(scalar or per-token), softcaps, k, K and the KL's direction and teacher hidden size at random,
for as long as ``--seconds`` allows, and checks each call with the kit's comparisons
(``fusedhead.testing.outputs``: values, gradients, ids, ignored rows). Meant for what the CPU
cannot check (bf16 on a GPU); runs anywhere the backend runs.

    python scripts/gpu/fuzz_outputs.py OUT_DIR [--backend triton] [--device cuda] [--dtype bf16]
                                       [--seconds 240] [--seed 0]

Writes ``OUT_DIR/fuzz_outputs.json`` (every case, its verdict and the failure message) and
prints one line a case; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import traceback
from typing import Any

import torch

from fusedhead.testing.inputs import IGNORE_INDEX, make_case
from fusedhead.testing.outcome import PropertyFailure
from fusedhead.testing.outputs import _check_kl, check_outputs, integer_case
from fusedhead.testing.target import Target

#: Shapes skewed to what breaks tiles: tiny, odd, one past a power of two, and a few large.
_SIZES_N = (1, 2, 3, 5, 9, 17, 63, 64, 65, 129, 255, 257, 511, 1000, 2049)
_SIZES_H = (1, 3, 7, 8, 15, 16, 33, 64, 100, 127, 128, 129, 255, 320, 1027)
_SIZES_V = (1, 2, 5, 15, 31, 127, 128, 129, 255, 257, 1000, 4099, 8193, 32001, 50000)


def _draw(rng: random.Random, caps: Any) -> dict[str, Any]:
    """One random problem within what the backend declares."""
    v = rng.choice(_SIZES_V)
    kinds = [o for o in ("topk", "gather", "argmax", "lse", "sum_p2") if o in caps.outputs]
    if caps.kl_directions:
        kinds.append("kl")
    kind = rng.choice(kinds)
    p: dict[str, Any] = {
        "kind": kind,
        "n": rng.choice(_SIZES_N),
        "h": rng.choice(_SIZES_H),
        "v": v,
        "scale": rng.choice((0.1, 1.0, 4.0, 10.0)),
        "temperature": round(math.exp(rng.uniform(math.log(0.1), math.log(5.0))), 3),
        "per_token": caps.per_token_temperature and rng.random() < 0.25,
        "softcap": rng.choice((None, None, None, 0.5, 3.0, 30.0)) if caps.softcap else None,
        "integer": kind in ("topk", "argmax") and v >= 4 and rng.random() < 0.3,
        "seed": rng.randrange(2**16),
    }
    if kind == "topk":
        p["k"] = min(rng.choice((1, 2, 7, 32, 64, caps.max_top_k)), caps.max_top_k, v)
    if kind == "gather":
        p["K"] = rng.choice((1, 2, 5, 32, 100, 256))
    if kind == "kl":
        p["direction"] = rng.choice(caps.kl_directions)
        p["teacher_h"] = rng.choice((p["h"], max(1, p["h"] // 2 + 1), rng.choice(_SIZES_H)))
        p["teacher_temperature"] = round(math.exp(rng.uniform(math.log(0.3), math.log(3.0))), 3)
        p["teacher_softcap"] = rng.choice((None, None, 2.0)) if caps.softcap else None
    return p


def _temps(p: dict[str, Any], n: int, key: str, seed: int) -> float | torch.Tensor:
    if not p["per_token"]:
        return float(p[key])
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.empty(n).uniform_(math.log(0.3), math.log(3.0), generator=g))


def run_case(target: Target, p: dict[str, Any]) -> None:
    """Check one drawn problem; raises ``PropertyFailure`` (or anything else) on a defect."""
    n, h, v, seed = p["n"], p["h"], p["v"], p["seed"]
    label = json.dumps(p, sort_keys=True)
    if p["kind"] == "kl":
        case = make_case(n, h, v, scale=p["scale"], seed=seed)
        teacher = make_case(n, p["teacher_h"], v, scale=p["scale"], seed=seed + 1)
        t_s = _temps(p, n, "temperature", seed + 2)
        t_t = _temps(p, n, "teacher_temperature", seed + 3)
        caps = (p["softcap"], p["teacher_softcap"])
        _check_kl(target, case, teacher, p["direction"], t_s, t_t, label, caps)
        return
    case = integer_case(n, min(h, 16), v, seed=seed) if p["integer"] else None
    if case is None:
        case = make_case(n, h, v, scale=p["scale"], seed=seed)
    temperature: float | torch.Tensor = 1.0 if p["integer"] else _temps(p, n, "temperature", seed)
    kw: dict[str, Any] = {"label": label, "temperature": temperature}
    if not p["integer"]:
        kw["softcap"] = p["softcap"]
    if p["kind"] == "topk":
        kw["k"] = p["k"]
    if p["kind"] == "gather":
        g = torch.Generator().manual_seed(seed + 4)
        ids = torch.randint(0, v, (n, p["K"]), generator=g)
        if p["K"] > 2:
            ids[:, -1] = IGNORE_INDEX
            ids[:, 0] = ids[:, 1]
        kw["gather_ids"] = ids
    check_outputs(target, case, (p["kind"],), exact_ranking=p["integer"], **kw)


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("out", help="output folder (fuzz_outputs.json)")
    args.add_argument("--backend", default="triton")
    args.add_argument("--device", default="cuda")
    args.add_argument("--dtype", default="bf16", choices=("fp32", "fp16", "bf16"))
    args.add_argument("--seconds", type=float, default=240.0, help="stop drawing after this long")
    args.add_argument("--seed", type=int, default=0)
    args.add_argument("--max-cases", type=int, default=100000)
    opts = args.parse_args()
    os.makedirs(opts.out, exist_ok=True)
    target = Target.resolve(opts.backend, None, opts.device, opts.dtype)
    rng = random.Random(opts.seed)
    results: list[dict[str, Any]] = []
    start = time.monotonic()
    while time.monotonic() - start < opts.seconds and len(results) < opts.max_cases:
        p = _draw(rng, target.caps)
        t0 = time.monotonic()
        try:
            run_case(target, p)
            verdict, message = "pass", ""
        except PropertyFailure as exc:
            verdict, message = "fail", str(exc)
        except Exception as exc:  # a crash is a defect too: keep going, record it
            verdict = "error"
            message = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        results.append({**p, "verdict": verdict, "message": message,
                        "seconds": round(time.monotonic() - t0, 3)})  # fmt: skip
        print(f"{verdict:5s} {json.dumps(p, sort_keys=True)} {message[:300]}", flush=True)
    bad = [r for r in results if r["verdict"] != "pass"]
    summary = {
        "backend": opts.backend,
        "device": torch.cuda.get_device_name() if opts.device == "cuda" else opts.device,
        "dtype": opts.dtype,
        "torch": torch.__version__,
        "cases": len(results),
        "failed": len(bad),
        "results": results,
    }
    with open(os.path.join(opts.out, "fuzz_outputs.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"fuzz_outputs: {len(results) - len(bad)} passed, {len(bad)} failed", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
