"""Issue 34, item 5: the parts of a W3 step (N one-float items, B = 65536, Shard.sample(B, 1, out=) +
update_priorities(batch.keys)), each timed alone in one process; medians of rounds.

    PYTHONPATH=. NUMBA_NUM_THREADS=2 python docs/benchmarks/issue34_w3_parts.py 1e7 5 0.3

Parts: step; sample (Shard.sample into out=); update (of the sampled batch's keys); uniforms (the shard's
rng into the kept buffer); sort (the kernel's counting sort of the draw uniforms, priority_draw._sort_order_into);
kernel (local_sample._sample_kernel as sample_again calls it); power (np.power of the weights to beta).
"""
import os
import sys

import numba
import numpy as np

import gear_mpi as gm
from gear_mpi.keys import GEN_MASK, SLOT_BITS, key_head
from gear_mpi.kernels import local_sample, priority_draw
from issue34_w3_shard import w3_setup
from probe_timing import median_time

N, ROUNDS, PH, B, sh, new_p, batch = w3_setup(sys.argv[1:])
rep = sh._repeat
st = sh.store
keys, probabilities, weights, lengths = batch.meta_numpy()
bounds, order, skeys = np.empty(B // 2 + 1, np.int64), np.empty(B, np.int64), np.empty(B)


def kernel():
    iscr, fscr = local_sample._scratch(B)
    local_sample._sample_kernel(sh.index._arrays, rep.draw_u, rep.place_u, st.start, st.length, st.status,
                                key_head(st.tag, st.rank), SLOT_BITS, GEN_MASK, st.capacity, rep.window, rep.code,
                                rep.prioritized, sh.column_addresses()[0], sh.spec.step_bytes_array, rep.outs,
                                batch._mask_np, keys, lengths, probabilities, weights, iscr, fscr,
                                local_sample.NO_GEN)


parts = dict(
    step=lambda: (sh.sample(B, 1, out=batch), sh.update_priorities(batch.keys, new_p)),
    sample=lambda: sh.sample(B, 1, out=batch),
    update=lambda: sh.update_priorities(batch.keys, new_p),
    uniforms=lambda: sh.rng.random(out=rep.uniforms),
    sort=lambda: priority_draw._sort_order_into(rep.draw_u, bounds, order, skeys),
    kernel=kernel,
    power=lambda: np.power(weights, np.float32(0.4), out=weights),
)
res = {k: [] for k in parts}
for r in range(ROUNDS):
    for name, fn in parts.items():
        sh.sample(B, 1, out=batch)
        fn()
        res[name].append(median_time(fn, PH, 5) * 1e3)
print("threads", numba.get_num_threads(), "N", N, "load", os.getloadavg(), gm.__file__)
for k, v in res.items():
    print(f"{k:9s} med {np.median(v):7.3f} ms  rounds {' '.join(f'{x:.3f}' for x in v)}")
