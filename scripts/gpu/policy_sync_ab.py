"""What the policy loss's backward read of its upstream scale costs a step timed as the bench
times it (``triton.testing.do_bench``: steps queued back to back): the step as it is, beside the
same step with the read left out (its scale is 1, so both compute the same values). The read
makes the host wait for the forward's kernels, so the next step's host work before its own read
can no longer overlap them: the difference bounds what a backward without the read would save.

    python scripts/gpu/policy_sync_ab.py [IMPL] [N]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).parent))
from policy_loss_bench import warm_step


def main() -> int:
    import fusedhead.policy_output as policy_output

    spec = sys.argv[1] if len(sys.argv) > 1 else "fused:triton"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    fn, h, w = warm_step(spec, n)

    def step() -> None:
        fn(h, w).backward()

    with_read = policy_output._scale_
    times: dict[str, list[float]] = {"read": [], "no read": []}
    for _ in range(3):  # interleaved rounds
        for name, scale in (("read", with_read), ("no read", lambda grads, s: None)):
            policy_output._scale_ = scale
            times[name].append(do_bench(step, warmup=300, rep=1500, return_mode="median"))
    policy_output._scale_ = with_read
    torch.cuda.synchronize()
    for name, ts in times.items():
        print(f"{spec} N={n}, backward scale {name}: " + " / ".join(f"{t:.2f}" for t in ts) + " ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
