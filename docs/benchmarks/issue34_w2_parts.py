"""Issue 34, item 3: the Python and dispatch pieces of a W2 step, each timed alone over 5 x 2000 calls from cache.

    PYTHONPATH=. NUMBA_NUM_THREADS=1 python docs/benchmarks/issue34_w2_parts.py
"""
import sys, time, os
import numpy as np
from gear_mpi.kernels import local_sample
from gear_mpi.selection import small_update
from gear_mpi.keys import GEN_MASK, SLOT_BITS, key_head
import numba
from issue34_w2_shard import w2_shard

N, B = int(os.environ.get("W2N", 100_000)), 256
shard, new_p, batch, keys = w2_shard(N, B)
spec = shard.spec
batch1 = shard.sample(1, 1)
st = shard.store
u = shard.rng.random(2 * B)
kk, pp, ww, ll = batch.meta_numpy()
kk1, pp1, ww1, ll1 = batch1.meta_numpy()
iscr, fscr = local_sample._scratch(B)
iscr1, fscr1 = local_sample._scratch(1)
kh = key_head(st.tag, st.rank)
ca = shard.column_addresses()[0]
sba = spec.step_bytes_array
bca = batch.column_addresses(); bca1 = batch1.column_addresses()
tree = shard.index._arrays
def kern():
    local_sample._sample_kernel(tree, u[:B], u[B:], st.start, st.length, st.status, kh, SLOT_BITS, GEN_MASK, st.capacity, 1, 0, True,
        ca, sba, bca, batch._mask_np, kk, ll, pp, ww, iscr, fscr, local_sample.NO_GEN)
u1 = u[:1]
def kern1():
    local_sample._sample_kernel(tree, u1, u1, st.start, st.length, st.status, kh, SLOT_BITS, GEN_MASK, st.capacity, 1, 0, True,
        ca, sba, bca1, batch1._mask_np, kk1, ll1, pp1, ww1, iscr1, fscr1, local_sample.NO_GEN)
idx = shard.index
lay = st.layout
def upd_few():
    small_update.update_few(keys, new_p, st.tag, st.rank, st.max_items, st.status, small_update._NO_ROW, False, 0.6, True,
                            idx._arrays, idx._flags1, idx._flags2)
k1, p1 = keys[:1].copy(), new_p[:1].copy()
def upd_few1():
    small_update.update_few(k1, p1, st.tag, st.rank, st.max_items, st.status, small_update._NO_ROW, False, 0.6, True,
                            idx._arrays, idx._flags1, idx._flags2)
pieces = {
    "sample(B)": lambda: shard.sample(B, 1, out=batch),
    "sample_one_call": lambda: __import__("gear_mpi.selection.one_call", fromlist=["x"]).sample_one_call(
        shard, batch, B, 1, 0),
    "_sample_kernel B": kern,
    "_sample_kernel 1": kern1,
    "sample(1)": lambda: shard.sample(1, 1, out=batch1),
    "update_priorities(B)": lambda: shard.update_priorities(keys, new_p),
    "update_priorities(tensor)": lambda: shard.update_priorities(batch.keys, new_p),
    "update_few B": upd_few,
    "update_few 1": upd_few1,
    "update_priorities(1)": lambda: shard.update_priorities(k1, p1),
    "rng.random(512)": lambda: shard.rng.random(512),
    "np.power(w)": lambda: np.power(ww, np.float32(0.4), out=ww),
    "hold": lambda: shard.hold().__enter__(),
    "keys.numpy()": lambda: batch.keys.numpy(),
    "check_can_sample": shard.check_can_sample,
}
for f in pieces.values():
    for _ in range(200): f()
res = {k: [] for k in pieces}
for r in range(5):
    for name, f in pieces.items():
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n): f()
        res[name].append((time.perf_counter() - t0) / n * 1e6)
print("threads", numba.get_num_threads(), "load", os.getloadavg())
for k, v in res.items():
    print(f"{k:28s} med {np.median(v):7.2f} us  min {min(v):7.2f}")
