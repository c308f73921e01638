"""Issue 34, item 5: a W3 training-loop step timed in parts, in one process: ``Shard.sample(B, 1, out=batch)``
then ``Shard.update_priorities(batch.keys, p)`` (N one-float items, B = 65536, Prioritized(0.6, 0.4)), each call
timed where the loop makes it (the update right after its sample, as in compare_peers' W3 step); medians of the
calls in each round.

    NUMBA_NUM_THREADS=2 PYTHONPATH=.:docs/benchmarks python docs/benchmarks/issue34_w3_steploop.py 1e7 3 1

Run it against an older checkout with ``PYTHONPATH=/old/checkout:docs/benchmarks`` to compare versions (the
first round includes compilation where that checkout's cache is cold).
"""
import sys
import time

import numpy as np

from issue34_w3_shard import w3_setup

N, ROUNDS, PH, B, sh, new_p, batch = w3_setup(sys.argv[1:])
clock = time.perf_counter
for r in range(ROUNDS):
    sample_s, update_s, step_s = [], [], []
    end = clock() + PH
    while clock() < end:
        t0 = clock()
        sh.sample(B, 1, out=batch)
        t1 = clock()
        sh.update_priorities(batch.keys, new_p)
        t2 = clock()
        sample_s.append(t1 - t0)
        update_s.append(t2 - t1)
        step_s.append(t2 - t0)
    print(f"round {r}: step {np.median(step_s) * 1e3:.3f} ms, sample {np.median(sample_s) * 1e3:.3f}, "
          f"update {np.median(update_s) * 1e3:.3f} ({len(step_s)} steps)")
