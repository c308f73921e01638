"""Issue 34, item 3: what a W2 step's work beyond the copy costs once the copy has emptied the caches.

    PYTHONPATH=.:docs/benchmarks NUMBA_NUM_THREADS=1 taskset -c 1 python docs/benchmarks/issue34_w2_cold.py 3

A shard of W2's size and priorities (100,000 one-step items, Prioritized(0.6, 0.4), seed 0) whose items are one
byte, so that its sample is the draw, placement and description of 256 items with next to no copy: its sample
kernel (the uniforms drawn first, as ``one_call.sample_again`` draws them), its whole ``Shard.sample(256, 1,
out=)``, its ``update_priorities`` of the batch's keys, and numpy's float32 power of 256 values (as the sample
raises its importance weights), each timed right after nothing, after the W2 floor (the bare gather of 256 random
4104-byte rows of the W2 shard: 1 MiB read, 1 MiB written) and after a 4 MiB ``np.copyto``. Medians of 1500
calls, one line per round. Argument: rounds.
"""
import sys
import time

import numpy as np

import gear_mpi as gm
from gear_mpi.kernels import local_sample
from gear_mpi.selection import one_call

from issue34_w2_shard import w2_floor, w2_shard

N, B = 100_000, 256
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
shard, new_p, batch, _ = w2_shard(N, B)
floor = w2_floor(shard, batch, B)
small = gm.Shard(gm.TrajectorySpec({"obs": ((1,), "uint8")}, max_length=1), N, gm.Prioritized(0.6, 0.4), seed=0)
rng = np.random.default_rng(0)
small.insert_packed({"obs": rng.integers(0, 255, (N, 1), dtype=np.uint8)}, np.ones(N, np.int64), rng.random(N) + 0.01)
sb = small.sample(B, 1)
for _ in range(2):
    small.sample(B, 1, out=sb)
rep = small._repeat  # the record of the repeated call: its uniforms' buffer and the batch's column addresses
ratios = rng.random(B).astype(np.float32) * 0.94 + 0.06
powered = np.empty_like(ratios)


def kernel():
    small.rng.random(out=rep.uniforms)
    one_call._call_kernel(small, rep.draw_u, rep.place_u, 1, rep.code, True, rep.outs, sb, B * rep.row_bytes,
                          local_sample.NO_GEN)


phases = {"kernel": kernel, "sample": lambda: small.sample(B, 1, out=sb),
          "update": lambda: small.update_priorities(sb.keys, new_p),
          "np.power": lambda: np.power(ratios, np.float32(0.4), out=powered)}
big, big2 = np.zeros(4 << 20, np.uint8), np.ones(4 << 20, np.uint8)
before = {"nothing": lambda: None, "floor": floor, "copy 4 MiB": lambda: np.copyto(big, big2)}
for r in range(ROUNDS):
    cells = []
    for pre_name, pre in before.items():
        for name, f in phases.items():
            ts = []
            for _ in range(1500):
                pre()
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            cells.append(f"{name} after {pre_name} {np.median(ts) * 1e6:.1f}")
    print(f"round {r} (us): " + ", ".join(cells))
