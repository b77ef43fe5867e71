"""The host's Python time in one policy-loss step on a GPU (cProfile), to find what the GPU waits
for before the step's first kernels: ``python scripts/gpu/policy_host_profile.py [IMPL] [N]``."""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from policy_loss_bench import warm_step


def main() -> int:
    spec = sys.argv[1] if len(sys.argv) > 1 else "fused:triton"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    fn, h, w = warm_step(spec, n)
    # the forward call's host time up to its return (its kernels queued, the GPU busy after);
    # its one read waits only for the small check kernels queued before it
    spans = []
    for _ in range(5):
        t = time.perf_counter()
        loss = fn(h, w)
        spans.append((time.perf_counter() - t) * 1e3)
        loss.backward()
        torch.cuda.synchronize()
    print(f"{spec} N={n}: host time of the forward call {sorted(spans)[2]:.2f} ms (median of 5)")
    prof = cProfile.Profile()
    for _ in range(5):
        prof.enable()
        loss = fn(h, w)
        prof.disable()
        loss.backward()
        torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
