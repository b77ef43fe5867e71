"""Per-kernel CUDA time of one policy-loss step (torch.profiler), to see where the time goes.

python scripts/gpu/policy_loss_profile.py OUT_DIR [IMPL ...]   # IMPL as policy_loss_bench.py names them
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from policy_loss_bench import build, make_inputs, warm_step


def dz_sweep(configs: list[tuple[int, int, int]]) -> None:
    """The dz kernel's CUDA time per (rows per program, warps, stages), N = 8192, one chunk."""
    import fusedhead_triton.policy as tp

    x = make_inputs(8192, 4096, 151936, torch.device("cuda"), torch.bfloat16)
    fn = build("fused:triton:policy_chunk_rows=8192", x)
    h = x["hidden"].detach().clone().requires_grad_()
    w = x["weight"].detach().clone().requires_grad_()
    for cfg in configs:
        tp.DZ_CONFIG = cfg
        for _ in range(2):
            fn(h, w).backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn(h, w).backward()
            torch.cuda.synchronize()
        times = {e.key: e.device_time_total / e.count / 1e3 for e in prof.key_averages()}
        print(
            f"dz config {cfg}: dz {times.get('policy_dz_kernel', float('nan')):.2f} ms, "
            f"logits {times.get('policy_logits_kernel', float('nan')):.2f} ms",
            flush=True,
        )


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if sys.argv[2:3] == ["--dz"]:
        dz_sweep(
            [(2, 4, 3), (1, 4, 3), (2, 4, 4), (4, 4, 3), (2, 8, 3), (4, 8, 4), (1, 2, 4), (2, 4, 3)]
        )
        return 0
    impls = sys.argv[2:] or ["fused:triton:policy_chunk_rows=8192", "unfused:triton"]
    for spec in impls:
        fn, h, w = warm_step(spec, 8192, runs=2)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            fn(h, w).backward()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        print(f"=== {spec}\n{table}", flush=True)
        (out / f"profile-{spec.replace(':', '_').replace('=', '-')}.txt").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
