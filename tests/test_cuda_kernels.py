"""The numba-cuda kernels against the CPU kernels, on the numba CUDA simulator.

The CUDA checks run in a subprocess (this file run as a script) with
``NUMBA_ENABLE_CUDASIM=1`` set before numba.cuda is imported, so the simulator
never leaks into the other tests of the pytest process. One subprocess runs every
check and prints one ``CHECK {json}`` line per check; each test below asserts one
of them. Sizes are small (at most about 2e3 simulated threads per launch).

Exactness: the CUDA kernels do the CPU kernels' float64 operations in the same
order (each block is summed left to right, the prefix is accumulated sequentially
in one thread), so draws, leaves, level sums/mins and prefix are compared with
exact equality -- no tolerance.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
SIM_TIMEOUT = 240


def _env(sim: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    else:
        env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


def _run_script(args: list[str], sim: bool, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=_env(sim), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


# ==== checks, run inside the simulator subprocess ===========================================
CHECKS: dict = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _rng(seed):
    import numpy as np
    return np.random.default_rng(seed)


N_TREE = 3 * 4096 + 1000  # four level-2 blocks: the binary search over prefix has work to do


def _weights(rng, n):
    w = rng.random(n) ** 3 * rng.choice([1e-3, 1.0, 1e3], n)
    w[rng.random(n) < 0.3] = 0.0
    w[64 * 5:64 * 7] = 0.0          # two empty level-1 blocks
    w[4096:2 * 4096] = 0.0          # an empty level-2 block
    w[-3:] = 0.0                    # the last leaves empty
    from gear_mpi.kernels import leaf_values
    return leaf_values(w)           # float32 values: what the host index's leaves hold


def _index_pair(w, threads=64):
    import numpy as np
    from gear_mpi.selection import DevicePriorityIndex, PriorityIndex
    idx = PriorityIndex(len(w))
    idx.set(np.arange(len(w)), w)
    return idx, DevicePriorityIndex.from_host(idx, threads=threads)


def _edge_uniforms(idx):
    """0, the largest double below 1, and every level-2 / some level-1 block boundary exactly."""
    import numpy as np
    total = idx.total
    u = [0.0, np.nextafter(1.0, 0.0), 0.5]
    u += list(idx.prefix[:-1] / total)
    cum = np.concatenate([[0.0], np.cumsum(idx.l1_sum)])
    u += list(cum[::7] / total)
    return np.clip(np.array(u), 0.0, np.nextafter(1.0, 0.0))


def _assert_same_arrays(host: dict, idx, what=""):
    import numpy as np
    from gear_mpi.kernels import TREE_FIELDS
    for name in TREE_FIELDS:
        a, b = host[name], getattr(idx, name)
        if not np.array_equal(a, b):
            bad = np.flatnonzero(a != b)
            raise AssertionError(f"{what}{name} differs at {bad[:5]}: device {a[bad[:5]]} vs cpu {b[bad[:5]]}")


@check
def draws_match_cpu():
    import numpy as np
    rng = _rng(1)
    w = _weights(rng, N_TREE)
    idx, dev = _index_pair(w)
    edge = _edge_uniforms(idx)
    u = np.concatenate([edge, rng.random(1000 - len(edge))])
    cpu = idx.draw(u)
    gpu = dev.draw(u).copy_to_host()
    bad = np.flatnonzero(cpu != gpu)
    assert len(bad) == 0, f"{len(bad)} of {len(u)} draws differ: {bad[:5]}"
    assert (w[gpu] > 0).all(), "a zero-priority leaf was drawn"
    assert dev.total == idx.total and dev.min_positive == idx.min_positive


@check
def draws_match_cpu_sorted_batch_path():
    """More draws than priority_draw.DRAW_THREADS_MIN: the CPU kernel's sorted runs, in parallel."""
    import numpy as np
    from gear_mpi.kernels import priority_draw
    rng = _rng(2)
    w = _weights(rng, N_TREE)
    idx, dev = _index_pair(w, threads=128)
    b = max(2112, priority_draw.DRAW_THREADS_MIN + 64)
    u = rng.random(b)
    u[:5] = [0.0, np.nextafter(1.0, 0.0), idx.prefix[1] / idx.total, idx.prefix[2] / idx.total, 0.5]
    cpu = idx.draw(u)
    gpu = dev.draw(cp_device(u)).copy_to_host()
    assert np.array_equal(cpu, gpu), f"{int((cpu != gpu).sum())} of {b} draws differ"


def cp_device(a):
    from numba import cuda
    return cuda.to_device(a)


@check
def draw_rounding_fallbacks():
    """Inconsistent sums (as rounding can leave them): both kernels fall back the same way."""
    import numpy as np
    from gear_mpi.kernels import cuda_priority as cp
    from gear_mpi.kernels import priority_draw
    from gear_mpi.kernels import priority_tree as tree
    from gear_mpi.kernels import Tree
    rng = _rng(3)
    w = _weights(rng, N_TREE)
    u = np.concatenate([np.linspace(0.0, np.nextafter(1.0, 0.0), 700), [np.nextafter(1.0, 0.0)]])
    last_pos = int(np.flatnonzero(w)[-1])

    def both(leaves, l0_sum, l1_sum, l2_sum, prefix):
        cpu = np.empty(len(u), np.int64)
        host = Tree(leaves, l0_sum, l1_sum, l1m, l2_sum, l2m, prefix)  # a draw reads no minimum
        priority_draw.draw(host, u, cpu)
        out = cp_device(np.full(len(u), -7, np.int64))
        cp.draw(Tree(*(cp_device(x) for x in host)), cp_device(u), out, threads=64)
        gpu = out.copy_to_host()
        assert np.array_equal(cpu, gpu), f"{int((cpu != gpu).sum())} draws differ: {np.flatnonzero(cpu != gpu)[:5]}"
        return cpu

    n1, n2 = tree.level_sizes(len(w))
    n0 = tree.line_count(len(w))
    l0s, l1s, l1m, l2s, l2m, pre = (np.zeros(n0), np.zeros(n1), np.full(n1, np.inf), np.zeros(n2),
                                    np.full(n2, np.inf), np.zeros(n2 + 1))
    tree.rebuild(Tree(w, l0s, l1s, l1m, l2s, l2m, pre))

    def above(l0):  # the levels above line sums ``l0``
        l1 = np.array([l0[b * 8:(b + 1) * 8].sum() for b in range(n1)])
        l2 = np.array([l1[c * 64:(c + 1) * 64].sum() for c in range(n2)])
        return l1, l2, np.concatenate([[0.0], np.cumsum(l2)])
    # (a) line sums larger than their leaves: targets near a line end overshoot the leaves
    l0_big = l0s * (1 + 1e-6)
    got = both(w, l0_big, *above(l0_big))
    assert got[-1] == last_pos, f"leaf fallback: drew {got[-1]}, expected the last positive leaf {last_pos}"
    # (a') level-1 sums larger than their lines: the line scan overshoots
    l1_big = l1s * (1 + 1e-6)
    l2_big = np.array([l1_big[c * 64:(c + 1) * 64].sum() for c in range(n2)])
    got = both(w, l0s, l1_big, l2_big, np.concatenate([[0.0], np.cumsum(l2_big)]))
    assert got[-1] // 8 == last_pos // 8, f"line fallback: drew {got[-1]}, expected the line of leaf {last_pos}"
    # (b) a total larger than the level-2 sums: the level-1 scan overshoots
    both(w, l0s, l1s, l2s, pre * (1 + 1e-9))
    # (c) a level-2 block with mass but empty children: the 'no positive entry' branch
    l2_odd = l2s.copy()
    l2_odd[1] = l2s.sum()                  # half of the mass, in a block whose leaves are all 0
    got = both(w, l0s, l1s, l2_odd, np.concatenate([[0.0], np.cumsum(l2_odd)]))
    assert np.isin(got, np.arange(4096, 8192)).any(), "the empty-children branch was not reached"


@check
def updates_match_cpu():
    import numpy as np
    from gear_mpi.kernels import leaf_values
    from gear_mpi.selection import DevicePriorityIndex, PriorityIndex
    rng = _rng(4)
    n = N_TREE
    idx = PriorityIndex(n)
    dev = DevicePriorityIndex(n, threads=64)
    _assert_same_arrays(dev.to_host(), idx, "fresh index: ")
    assert dev.total == 0.0 and dev.min_positive == np.inf
    # full load + rebuild on both sides
    w = _weights(rng, n)
    idx.leaves[:] = w
    idx.rebuild()
    dev.leaves.copy_to_device(w)
    dev.rebuild()
    _assert_same_arrays(dev.to_host(), idx, "rebuild: ")
    # total and min_positive are kept between changes: the rebuild let go of the fresh index's 0 and inf
    assert dev.total == idx.total > 0 and dev.min_positive == idx.min_positive < np.inf
    rounds = []
    hot = rng.integers(0, n, 250)
    s = rng.choice(hot, 600)                      # many duplicates: the last one must win
    rounds.append((s, rng.random(600) * rng.choice([0.0, 1.0, 7.5], 600)))
    s = np.arange(64 * 9, 64 * 10)                # empty a whole level-1 block
    rounds.append((np.concatenate([s, s[:10]]), np.zeros(len(s) + 10)))
    s = np.flatnonzero(idx.leaves[:4096] > 0)     # empty the whole first level-2 block ...
    rounds.append((s, np.zeros(len(s))))
    s = rng.integers(0, n, 500)                   # ... then refill some of it, with repeats
    s[:200] = rng.integers(0, 300, 200)
    rounds.append((s, rng.random(500) ** 4))
    from gear_mpi.kernels import priority_tree as tree
    big = getattr(tree, "SET_SERIAL_MAX", 1024) + 50  # the CPU kernel's grouped (parallel) path
    s = rng.choice(rng.integers(0, n, 1500), big)
    rounds.append((s, rng.random(big)))
    for k, (slots, values) in enumerate(rounds):
        slots = slots.astype(np.int64)
        idx.set(slots, values)
        if k % 2:
            dev.set(cp_device(slots), cp_device(values.astype(np.float64)))  # device inputs
        else:
            dev.set(slots, values)                                           # host inputs
        host = dev.to_host()
        _assert_same_arrays(host, idx, f"round {k}: ")
        last = {}
        for sl, v in zip(slots, values):
            last[int(sl)] = v
        got = host["leaves"][list(last)]
        want = leaf_values(np.array(list(last.values())))  # both indexes hold each weight rounded to float32
        assert np.array_equal(got, want), f"round {k}: the last duplicate did not win"
        assert dev.total == idx.total, f"round {k}: total {dev.total} vs {idx.total}"
        assert dev.min_positive == idx.min_positive
    # the updated structure equals a CPU rebuild from its leaves, bit for bit
    ref = PriorityIndex(n)
    ref.leaves[:] = dev.to_host()["leaves"]
    ref.rebuild()
    _assert_same_arrays(dev.to_host(), ref, "against a CPU rebuild: ")
    assert np.isinf(dev.to_host()["l2_min"]).sum() == np.isinf(idx.l2_min).sum()
    u = np.concatenate([_edge_uniforms(idx), rng.random(300)])
    assert np.array_equal(dev.draw(u).copy_to_host(), idx.draw(u))
    # draw_to_host: the same slots, their weights drawn with them and kept for weights_of until a change
    slots = dev.draw_to_host(u)
    assert np.array_equal(slots, idx.draw(u)) and np.array_equal(dev.weights_of(slots), idx.leaves[slots])
    slots[0] = (slots[0] + 1) % n  # the caller's change to its slots: weights_of looks them up on the device
    assert np.array_equal(dev.weights_of(slots), idx.leaves[slots])
    slots = dev.draw_to_host(u[:50])
    idx.set(slots[:5], np.full(5, 0.125))
    dev.set(slots[:5], np.full(5, 0.125))  # a change: the kept weights are stale and let go
    assert np.array_equal(dev.weights_of(slots), idx.leaves[slots]) and dev.weights_of(slots)[0] == 0.125
    assert dev.total == idx.total and dev.min_positive == idx.min_positive
    # emptied: min_positive is inf, total 0 (a small index)
    small, dsmall = PriorityIndex(300), DevicePriorityIndex(300, threads=64)
    s = rng.integers(0, 300, 200)
    for vals in (rng.random(200) + 0.5, np.zeros(200)):
        small.set(s, vals)
        dsmall.set(s, vals)
        _assert_same_arrays(dsmall.to_host(), small, "small: ")
    assert dsmall.total == 0.0 == small.total and dsmall.min_positive == np.inf == small.min_positive


@check
def device_index_state_round_trip():
    """sections/restore of the device index: from leaves only, and from a CPU index's level arrays."""
    import numpy as np
    from gear_mpi.selection import DevicePriorityIndex, PriorityIndex
    rng = _rng(5)
    w = rng.random(4096 + 700) * (rng.random(4096 + 700) > 0.3)  # two level-2 blocks, small for the simulator
    count = len(w) - 100
    w[count:] = 0.0
    idx, dev = _index_pair(w)
    assert DevicePriorityIndex.KIND == "generic" and [n for n, _ in dev.sections(count)] == ["leaves"]
    assert np.array_equal(dev.sections(count)[0][1], idx.leaves[:count])
    for sections in (dict(dev.sections(count)), dict(idx.sections(count))):
        fresh = DevicePriorityIndex(len(w), threads=64)
        assert fresh.total == 0.0 and fresh.min_positive == np.inf  # kept ...
        fresh.restore(sections, count)
        _assert_same_arrays(fresh.to_host(), idx, f"restore from {sorted(sections)}: ")
        assert fresh.total == idx.total and fresh.min_positive == idx.min_positive  # ... until the restore
    back = PriorityIndex(len(w))
    back.restore(dict(dev.sections(count)), count)
    _assert_same_arrays(dev.to_host(), back, "CPU restore from device sections: ")


@check
def index_argument_checks():
    import numpy as np
    from gear_mpi.selection import DevicePriorityIndex
    dev = DevicePriorityIndex(100, threads=32)
    for bad in (lambda: dev.set([1, 2], [1.0]), lambda: dev.set([100], [1.0]), lambda: dev.set([-1], [1.0]),
                lambda: DevicePriorityIndex(0), lambda: DevicePriorityIndex(10, threads=2048),
                lambda: dev.draw(cp_device(np.zeros(3, np.float32)))):
        try:
            bad()
        except (ValueError, IndexError, TypeError):
            pass
        else:
            raise AssertionError("a bad argument was accepted")
    dev.set([], [])
    assert len(dev) == 100 and "DevicePriorityIndex" in repr(dev)


# ---- gather -------------------------------------------------------------------------------
def _aligned_slice(dev_big, nbytes, mod16):
    """A slice of a device byte array whose address is ``mod16`` modulo 16."""
    from gear_mpi.kernels import cuda_gather as cg
    off = (mod16 - cg.device_address(dev_big)) % 16
    v = dev_big[off:off + nbytes]
    assert cg.device_address(v) % 16 == mod16
    return v


def _windows(rng, capacity, window, b):
    """Window coordinates: wrap-around, head and tail padding, full windows; rows permuted."""
    import numpy as np
    starts = rng.integers(0, capacity, b)
    starts[:3] = [capacity - 2, capacity - 1, 0]
    n_valid = rng.integers(1, window + 1, b)
    n_valid[:3] = [window, window - 1, window]
    pad_front = np.where(rng.random(b) < 0.5, window - n_valid, 0)
    pad_front[1] = 1
    rows = rng.permutation(b + 2)[:b]     # two rows are never written: they must stay as they were
    return [np.ascontiguousarray(a, np.int64) for a in (starts, n_valid, pad_front, rows)]


@check
def gather_matches_cpu():
    import numpy as np
    from gear_mpi.kernels import cuda_gather as cg
    from gear_mpi.kernels import gather as g
    rng = _rng(5)
    capacity, window, b = 23, 6, 10
    cases = 0
    for step_bytes in (16, 12, 7, 40):
        src_np = rng.integers(0, 256, capacity * step_bytes + 64).astype(np.uint8)
        src_big = cp_device(src_np)
        starts, n_valid, pad_front, rows = _windows(rng, capacity, window, b)
        out_bytes = (b + 2) * window * step_bytes
        for smod, dmod in ((0, 0), (3, 3), (3, 5), (8, 0)):
            src = _aligned_slice(src_big, capacity * step_bytes, smod)
            ref = np.full(out_bytes, 0xAB, np.uint8)
            g.gather_windows(src.copy_to_host(), capacity, step_bytes, starts, n_valid, pad_front, rows, ref, window)
            # two threads a block as well: the 16-byte path's four-chunk unrolled loop runs only where a
            # window holds at least four chunks per thread
            for vec, threads in [(v, 32) for v in cg.VECS] + [(16, 2)]:
                out_big = cp_device(np.full(out_bytes + 32, 0xAB, np.uint8))
                out = _aligned_slice(out_big, out_bytes, dmod)
                cg.gather_windows(src, capacity, step_bytes, starts, n_valid, pad_front, rows, out, window,
                                  threads=threads, vec=vec)
                got = out.copy_to_host()
                assert np.array_equal(got, ref), (f"step_bytes={step_bytes} src%16={smod} dst%16={dmod} vec={vec} "
                                                  f"threads={threads}: {int((got != ref).sum())} bytes differ")
                cases += 1
    assert cases == 64


@check
def gather_takes_vector_path_only_when_aligned():
    """White box: hand the kernel a zeroed uint64 view, so bytes moved in chunks come out 0."""
    import numpy as np
    from gear_mpi.kernels import cuda_gather as cg
    sb, cap, window = 64, 4, 1
    src_np = np.arange(1, cap * sb + 1, dtype=np.uint8)   # no zero byte
    one = np.zeros(1, np.int64)
    for smod, dmod, vec, chunked in ((0, 0, 16, range(0, 64)), (3, 3, 16, range(13, 61)), (3, 3, 8, range(5, 61)),
                                     (3, 5, 16, range(0)), (0, 8, 16, range(0)), (0, 8, 8, range(0, 64)),
                                     (0, 0, 0, range(0))):
        src = _aligned_slice(cp_device(np.concatenate([src_np, np.zeros(32, np.uint8)])), cap * sb, smod)
        out = _aligned_slice(cp_device(np.full(sb + 32, 0xAB, np.uint8)), sb, dmod)
        _, shead = cg.word_view(src, vec)
        out64, ohead = cg.word_view(out, vec)
        zeros64 = cp_device(np.zeros(cap * sb // 8 + 2, np.uint64))
        cg.gather_kernel[1, 32](src, zeros64, shead, cap, sb, one + 1, one + 1, one, one, out, out64, ohead, window,
                                vec)
        got = out.copy_to_host()
        expect = src.copy_to_host()[sb:2 * sb]
        assert expect.all()
        expect[list(chunked)] = 0
        assert np.array_equal(got, expect), f"src%16={smod} dst%16={dmod} vec={vec}: {np.flatnonzero(got != expect)}"


@check
def mask_matches_cpu():
    import numpy as np
    from numba import cuda
    from gear_mpi.kernels import cuda_gather as cg
    from gear_mpi.kernels import gather as g
    rng = _rng(6)
    window, b = 9, 12
    _, n_valid, pad_front, rows = _windows(rng, 50, window, b)
    ref = np.ones((b + 2, window), np.bool_)
    g.fill_mask(n_valid, pad_front, rows, ref)
    dev = cuda.to_device(np.ones((b + 2, window), np.bool_))
    cg.fill_mask(n_valid, pad_front, rows, dev, threads=4)   # fewer threads than steps: the stride loop
    assert np.array_equal(dev.copy_to_host(), ref)
    cg.fill_mask(n_valid[:0], pad_front[:0], rows[:0], dev)
    cg.gather_windows(cp_device(np.zeros(8, np.uint8)), 1, 8, n_valid[:0], n_valid[:0], n_valid[:0], n_valid[:0],
                      cp_device(np.zeros(8, np.uint8)), 1)


@check
def shard_gather_into_matches_cpu():
    """A real shard (numpy and shared memory), ring wrapped by evictions, mapped with pinned.py."""
    import numpy as np
    from numba import cuda
    import gear_mpi as gm
    from gear_mpi.storage import pinned
    from gear_mpi.batch import Batch
    from gear_mpi.kernels import cuda_gather as cg
    from gear_mpi.storage import gather_into
    spec = gm.TrajectorySpec({"t": ((), "int64"), "obs": ((3, 2), "float32"), "act": ((2,), "int16"),
                              "done": ((), "bool"), "img": ((5,), "uint8")}, max_length=12)
    rng = _rng(7)
    for memory in ("private", "shm"):
        with gm.Shard(spec, 50, gm.Prioritized(0.7, 0.4), memory=memory, seed=3, tag=1) as shard:
            for i in range(14):
                ln = int(rng.integers(1, 13))
                shard.insert({"t": np.arange(ln) + 1000 * i, "obs": rng.standard_normal((ln, 3, 2)),
                              "act": rng.integers(-9, 9, (ln, 2)).astype(np.int16),
                              "done": rng.random(ln) < 0.5, "img": rng.integers(0, 255, (ln, 5)).astype(np.uint8)},
                             priority=float(rng.random() + 0.1))
            st = shard.store
            mapping, views = pinned.map_byte_views(st.arena.buffer, st.byte_views())
            try:
                assert mapping.mode == "simulator"
                for window, code in ((5, 0), (12, 1), (16, 2), (20, 0)):
                    b = 7
                    slots = shard.select(b)
                    win_start, n_valid, pad_front = shard.place(slots, window, code)
                    rows = np.arange(b, dtype=np.int64)[::-1].copy()
                    ref = Batch.empty(spec, b, window)
                    gather_into(st.byte_views(), spec, st.capacity, win_start, n_valid, pad_front, rows, ref)
                    cols = {c.name: cuda.device_array((b, window) + c.shape, c.dtype) for c in spec.columns}
                    mask = cuda.device_array((b, window), np.bool_)
                    cg.gather_into(views, spec, st.capacity, win_start, n_valid, pad_front, rows, cols, mask,
                                   threads=32)
                    for c in spec.columns:
                        got, exp = cols[c.name].copy_to_host(), ref.numpy()[c.name]
                        assert np.array_equal(got.view(np.uint8), exp.view(np.uint8)), f"{memory} {c.name} W={window}"
                    assert np.array_equal(mask.copy_to_host(), ref._mask_np)
            finally:
                mapping.close()


def _bump_kernel():
    # the simulator swaps the kernel's *global* ``cuda`` for its fake module: bind it globally
    global cuda
    from numba import cuda

    @cuda.jit
    def bump(a):
        i = cuda.grid(1)
        if i < a.shape[0]:
            a[i] += 1
    return bump


@check
def pinned_is_a_plain_view_under_the_simulator():
    import numpy as np
    from gear_mpi.storage import pinned
    from gear_mpi.storage import SharedArena
    bump = _bump_kernel()
    assert pinned.is_simulator()
    buf = np.zeros(256, np.uint8)
    with pinned.map_host(buf) as m:
        assert m.mode == "simulator" and m.nbytes == 256 and "simulator" in repr(m)
        bump[4, 64](m.device)                       # kernel writes land in the host buffer: no copy
        assert (buf == 1).all()
        buf[:] = 5
        assert (m.device.copy_to_host() == 5).all()  # host writes are seen through the device view
        assert pinned.map_host(buf) is m             # already mapped: the same mapping
        sub = pinned.map_host(buf[64:128])           # inside a mapping: a view that owns nothing
        assert sub is not m and sub.mode == "simulator"
        bump[1, 64](sub.device)
        assert (buf[64:128] == 6).all() and (buf[:64] == 5).all()
        sub.close()
        f32 = buf[16:48].view(np.float32).reshape(2, 4)
        dv = m.view(f32)
        assert dv.shape == (2, 4) and dv.dtype == np.float32
        dv[0, 0] = 2.5
        assert f32[0, 0] == 2.5
        for bad in (lambda: m.view(np.zeros(4, np.uint8)), lambda: m.view(buf[::2]),
                    lambda: pinned.map_host(np.zeros(0, np.uint8)),
                    lambda: pinned.map_host(buf.reshape(16, 16)[:, ::2]),
                    lambda: pinned.map_host([1, 2]), lambda: pinned.map_byte_views(buf[:10], {"x": buf[5:20]})):
            try:
                bad()
            except (ValueError, TypeError):
                pass
            else:
                raise AssertionError("a bad argument was accepted")
        ro = np.zeros(16, np.uint8)
        ro.flags.writeable = False
        try:
            pinned.map_host(ro)
        except ValueError:
            pass
        else:
            raise AssertionError("a read-only buffer was mapped")
    assert m.closed and "closed" in repr(m)
    m.close()                                        # idempotent
    m2 = pinned.map_host(buf)
    assert m2 is not m
    m2.close()
    # POSIX shared memory: a kernel's writes through the mapping are seen by another process's mapping
    arena = SharedArena(4096)
    other = SharedArena.attach(arena.name)
    try:
        with pinned.map_host(arena.buffer) as m3:
            bump[64, 64](m3.device)
            assert (other.buffer == 1).all()
    finally:
        other.close()
        arena.close()


def _main_sim(names):
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    import time
    for name in names:
        t0 = time.perf_counter()
        try:
            CHECKS[name]()
            res = {"check": name, "ok": True, "detail": ""}
        except Exception:
            res = {"check": name, "ok": False, "detail": traceback.format_exc()}
        res["seconds"] = round(time.perf_counter() - t0, 2)
        print("CHECK " + json.dumps(res), flush=True)


# The exceptions that mean "the CUDA compiler libraries are not installed": cuda-pathfinder's
# not-found errors (numba-cuda >= 0.2x finds libnvvm, libnvrtc and libdevice with it; the
# DynamicLibNotAvailableError / DynamicLibUnknownError subclasses included) and numba-cuda's
# NVVM / NVRTC support errors. Matched by class name so that no version's module layout is assumed.
MISSING_LIBRARY_ERRORS = frozenset({"DynamicLibNotFoundError", "BitcodeLibNotFoundError", "NvvmSupportError",
                                    "NvrtcSupportError"})


def missing_cuda_library(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says a CUDA library is not installed."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(cls.__name__ in MISSING_LIBRARY_ERRORS for cls in type(exc).__mro__):
            return True
        exc = exc.__cause__
    return False


def _main_plain():
    """Without the simulator: ``import gear_mpi`` must not import numba.cuda; then compile every
    kernel to PTX for sm_90 without a GPU. Needs libnvvm/libnvrtc: prints ``PTX SKIP`` when one is
    missing, and fails (traceback, exit status 1) on any other error -- numba-cuda refusing this
    numpy, first of all, as :func:`gear_mpi.kernels.cuda_support.check_versions` says."""
    import types
    import gear_mpi  # noqa: F401
    print("IMPORT " + ("numba.cuda imported" if "numba.cuda" in sys.modules else "OK"), flush=True)
    from gear_mpi.kernels import cuda_support
    cuda_support.check_versions()
    from numba import cuda, float64, int64
    import numba.cuda.dispatcher as dispatcher

    def tiny(a):
        a[0] = 1.0
    try:
        cuda.compile_ptx(tiny, (float64[::1],), cc=(9, 0))
    except Exception as exc:
        if not missing_cuda_library(exc):
            raise
        print("PTX SKIP " + f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return
    from gear_mpi.kernels import cuda_gather as cg
    from gear_mpi.kernels import cuda_priority as cp
    # device functions are compiled for the current device: name one instead of asking a driver
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
    f, i = float64[::1], int64[::1]
    sigs = {cp.draw_kernel: (f, f, f, f, f, f, i, f), cp._claim_kernel: (i, i), cp._write_kernel: (f, i, i, f),
            cp._l0_kernel: (f, f, i), cp._l1_kernel: (f, f, f, f, i), cp._l2_kernel: (f, f, f, f, i),
            cp._l0_all_kernel: (f, f), cp._l1_all_kernel: (f, f, f, f),
            cp._l2_all_kernel: (f, f, f, f), cp._prefix_kernel: (f, f), cp._min_kernel: (f, f),
            cp._fill_kernel: (f, float64), cp._take_kernel: (f, i, f)}
    sigs.update(cg._ptx_signatures())
    for k, sig in sigs.items():
        ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))
        assert ".entry" in ptx, k
    print(f"PTX OK {len(sigs)} kernels")


if __name__ == "__main__":
    if sys.argv[1:] == ["--plain"]:
        _main_plain()
    else:
        _main_sim(sys.argv[1:] or list(CHECKS))
    sys.exit(0)


# ==== pytest side ===========================================================================
# the checks run by the first simulator process (about half of the time); the rest run in a second one
FIRST_PROCESS = frozenset({"updates_match_cpu", "draws_match_cpu", "draw_rounding_fallbacks", "index_argument_checks",
                         "mask_matches_cpu"})
@pytest.fixture(scope="module")
def runs():
    """The four subprocesses, started together (they are independent): the simulator checks (two halves),
    ``gpu_check.py --sim --json`` and the plain (no simulator) import + PTX check."""
    # the simulator checks in two processes (about 30 s of CPU each here), beside the other two: 2 cores kept busy
    first, second = [n for n in CHECKS if n in FIRST_PROCESS], [n for n in CHECKS if n not in FIRST_PROCESS]
    cmds = {"sim": ([HERE, *first], True), "sim2": ([HERE, *second], True),
            "gpu_check": (["-m", "scripts.checks.gpu_check", "--sim", "--json"], True),
            "plain": ([HERE, "--plain"], False)}
    procs = {k: subprocess.Popen([sys.executable, *args], env=_env(sim), cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for k, (args, sim) in cmds.items()}
    out = {}
    for k, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=SIM_TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            stderr += f"\n[timed out after {SIM_TIMEOUT} s]"
        out[k] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


@pytest.fixture(scope="module")
def sim_results(runs):
    results = {}
    for key in ("sim", "sim2"):
        for line in runs[key].stdout.splitlines():
            if line.startswith("CHECK "):
                r = json.loads(line[6:])
                results[r["check"]] = r
    return results, runs


@pytest.mark.parametrize("name", list(CHECKS))
def test_cuda_kernel_on_simulator(sim_results, name):
    results, runs = sim_results
    if name not in results:
        proc = runs["sim" if name in FIRST_PROCESS else "sim2"]
        raise AssertionError(f"check {name} did not report (rc={proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    assert results[name]["ok"], results[name]["detail"]


def test_importing_gear_mpi_does_not_import_numba_cuda(runs):
    proc = runs["plain"]
    assert "IMPORT OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_kernels_compile_to_ptx(runs):
    """Where libnvvm is installed (no GPU needed), every kernel must type-check and compile for sm_90.

    Skipped only when a CUDA library is missing (``pip install -e .[cuda13]`` or ``[cuda12]``
    installs them, about 450 MB); any other error fails.
    """
    proc = runs["plain"]
    if "PTX SKIP" in proc.stdout:
        pytest.skip("CUDA compiler library not installed (install gear-mpi[cuda13] or [cuda12] to run this): "
                    + proc.stdout.split("PTX SKIP", 1)[1].strip()[:200])
    assert proc.returncode == 0 and "PTX OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_only_a_missing_library_skips_the_ptx_check():
    """numpy 2.5 without ``np.row_stack`` once showed up as a skip: only library errors may skip."""
    class DynamicLibNotFoundError(RuntimeError):
        pass

    class DynamicLibNotAvailableError(DynamicLibNotFoundError):
        pass

    class NvvmSupportError(ImportError):
        pass

    assert missing_cuda_library(DynamicLibNotFoundError('Failure finding "libnvrtc.so.13"'))
    assert missing_cuda_library(DynamicLibNotAvailableError("nvvm"))
    wrapped = RuntimeError("compilation failed")
    wrapped.__cause__ = NvvmSupportError("libNVVM is not available")
    assert missing_cuda_library(wrapped)
    assert not missing_cuda_library(AttributeError("module 'numpy' has no attribute 'row_stack'"))
    assert not missing_cuda_library(RuntimeError("numba-cuda 0.30.4 cannot compile CUDA kernels with numpy 2.5.5"))
    assert not missing_cuda_library(ImportError("no module named numba.cuda"))
    handling = AttributeError("row_stack")
    handling.__context__ = DynamicLibNotFoundError("raised while handling it: not the cause")
    assert not missing_cuda_library(handling)


def test_installed_numba_cuda_and_numpy_compile_kernels():
    """The environment the tests run in (the newest numpy the extras' pins allow, in CI's fresh
    install) is one whose kernels compile, whether or not the PTX check above can run here."""
    from gear_mpi.kernels import cuda_support
    numpy_version, numba_cuda_version = cuda_support.installed_versions()
    assert numba_cuda_version is not None, "the test extra installs numba-cuda"
    cuda_support.check_versions()


@pytest.mark.parametrize("numpy_version, numba_cuda_version, fails", [
    ("2.5.5", "0.30.4", True), ("2.5.0", "0.21.1", True), ("2.5.0rc1", "0.28.2", True), ("3.0.0", "0.30.0", True),
    ("2.4.6", "0.30.4", False), ("1.26.4", "0.22.0", False), ("2.5.5", "0.20.1", False)])
def test_version_guard_names_the_versions_and_the_fix(monkeypatch, numpy_version, numba_cuda_version, fails):
    from gear_mpi.kernels import cuda_support
    monkeypatch.setattr(cuda_support, "installed_versions", lambda: (numpy_version, numba_cuda_version))
    monkeypatch.setattr(cuda_support, "_registers_row_stack", lambda: pytest.fail("only newer releases are probed"))
    if not fails:
        cuda_support.check_versions()
        return
    with pytest.raises(RuntimeError) as info:
        cuda_support.check_versions()
    msg = str(info.value)
    assert f"numba-cuda {numba_cuda_version}" in msg and f"numpy {numpy_version}" in msg
    assert "pip install 'numpy<2.5'" in msg and "row_stack" in msg and "NUMBA_ENABLE_CUDASIM=1" in msg


def test_version_guard_probes_releases_it_has_not_read(monkeypatch):
    from gear_mpi.kernels import cuda_support
    probes = []
    for still_broken in (True, False):
        monkeypatch.setattr(cuda_support, "_registers_row_stack", lambda b=still_broken: probes.append(b) or b)
        if still_broken:
            with pytest.raises(RuntimeError, match="numba-cuda 0.31.0 cannot compile"):
                cuda_support.check_versions("2.5.5", "0.31.0")
        else:
            cuda_support.check_versions("2.5.5", "0.31.0")
    cuda_support.check_versions("2.4.6", "0.31.0")   # numpy still has row_stack: nothing to probe
    assert probes == [True, False]
    monkeypatch.setattr(cuda_support, "installed_versions", lambda: ("2.5.5", None))
    cuda_support.check_versions()                     # no numba-cuda: nothing to judge


def test_cuda_module_checks_versions_off_the_simulator_only(monkeypatch):
    from gear_mpi.kernels import cuda_support
    monkeypatch.setattr(cuda_support, "_CUDA", [])
    monkeypatch.setattr(cuda_support, "installed_versions", lambda: ("2.5.5", "0.30.4"))
    monkeypatch.setattr(cuda_support, "simulator_enabled", lambda: False)
    with pytest.raises(RuntimeError, match="numpy 2.5.5"):
        cuda_support.cuda_module()
    assert cuda_support._CUDA == []                   # nothing imported, asked again next time
    # under the simulator nothing is checked (a stand-in numba.cuda keeps the real one out of this process)
    import types
    import numba
    monkeypatch.setattr(cuda_support, "simulator_enabled", lambda: True)
    monkeypatch.setattr(cuda_support, "check_versions", lambda: pytest.fail("checked under the simulator"))
    fake = types.ModuleType("numba.cuda")
    monkeypatch.setitem(sys.modules, "numba.cuda", fake)
    monkeypatch.delattr(numba, "cuda", raising=False)
    assert cuda_support.cuda_module() is fake


def test_gpu_check_script_runs_on_the_simulator(runs):
    proc = runs["gpu_check"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["mode"] == "simulator" and report["ok"]
    rows = report["rows"]
    matches = [r for r in rows if r["section"] == "match"]
    assert len(matches) >= 10 and all(r["match"] == "yes" for r in matches), matches
    sections = {r["section"] for r in rows}
    assert {"match", "bandwidth", "selection", "sample"} <= sections, sections
    assert not [r for r in rows if r.get("error")], [r for r in rows if r.get("error")]
    cases = " ".join(r["case"] for r in rows)
    for needed in ("gather zero-copy", "host-to-device copy (pinned)", "gear draw", "torch.multinomial"):
        assert needed in cases, needed


def test_gpu_check_script_without_a_gpu_exits_cleanly():
    proc = _run_script(["-m", "scripts.checks.gpu_check"], sim=False, timeout=120)
    if "no CUDA GPU" not in proc.stdout:
        pytest.skip("this machine has a CUDA GPU: the no-GPU path is not exercised here")
    assert proc.returncode == 0, proc.stderr
    assert "--sim" in proc.stdout


def test_small_launches_do_not_warn_and_leave_the_setting_as_it_was(monkeypatch):
    """numba warns at every launch of fewer than 128 blocks (seen on an H100: one warning per sample);
    ``launch`` lowers the setting for gear_mpi's own small launches only, and puts it back, also when the
    launch fails."""
    import types
    from gear_mpi.kernels import cuda_support
    settings = types.SimpleNamespace(CUDA_LOW_OCCUPANCY_WARNINGS=1)
    monkeypatch.setattr(cuda_support, "_launch_settings", lambda: settings)
    monkeypatch.setattr(cuda_support, "simulator_enabled", lambda: False)
    seen = []

    class Kernel:
        def __getitem__(self, config):
            seen.append((config, settings.CUDA_LOW_OCCUPANCY_WARNINGS))
            if config[0] == 7:
                raise RuntimeError("launch failed")
            return config

    k = Kernel()
    assert cuda_support.launch(k, 1, 256) == (1, 256)
    assert cuda_support.launch(k, 128, 64) == (128, 64)
    with pytest.raises(RuntimeError, match="launch failed"):
        cuda_support.launch(k, 7, 32)
    assert seen == [((1, 256), 0), ((128, 64), 1), ((7, 32), 0)]
    assert settings.CUDA_LOW_OCCUPANCY_WARNINGS == 1
    settings.CUDA_LOW_OCCUPANCY_WARNINGS = 0   # a user who turned them off keeps them off
    cuda_support.launch(k, 2, 32)
    assert settings.CUDA_LOW_OCCUPANCY_WARNINGS == 0


PIN_LIFETIME = r"""
import ctypes, gc, sys
import numpy as np
from numba.cuda.cudadrv import driver
from gear_mpi.storage import pinned
freed, unraisable = [], []
sys.unraisablehook = unraisable.append
# numba's own record of a registration (the class mempin's mapped record derives from), with a finalizer that
# stands for cuMemHostUnregister, behind the owned pointer mempin returns
record = driver.AutoFreePointer(None, ctypes.c_void_p(1 << 20), 1 << 16, finalizer=lambda: freed.append(1))
pin = record.own()
host = np.zeros(1 << 16, np.uint8)
m = pinned.MappedBuffer(host, None, None, "mapped", pin=pin)
view = pin.view(0, 64)
del pin
gc.collect()
assert freed == [], "unregistered while the mapping is open"
m.close()
assert freed == [1], "close() did not unregister"
m.close()
del view
m = None
gc.collect()
assert freed == [1], freed
assert not unraisable, [str(u.exc_value) for u in unraisable]
print("PIN OK")
"""


def test_closing_a_mapping_unregisters_once_whatever_views_outlive_it():
    """Seen on an H100: ``close()`` freed numba's registration record, then the views and the owned pointer
    that outlived it brought numba's count to zero and freed it again, printing "Freeing dead memory" from
    their finalizers. numba's real record and owned pointer, with a finalizer in place of the driver call."""
    pytest.importorskip("numba.cuda")
    proc = _run_script(["-c", PIN_LIFETIME], sim=False, timeout=120)
    assert proc.returncode == 0 and "PIN OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_numba_cuda_without_the_warning_setting_still_launches(monkeypatch):
    import types
    from gear_mpi.kernels import cuda_support
    monkeypatch.setattr(cuda_support, "_launch_settings", lambda: types.SimpleNamespace())
    monkeypatch.setattr(cuda_support, "simulator_enabled", lambda: False)

    class Kernel:
        def __getitem__(self, config):
            return config

    assert cuda_support.launch(Kernel(), 1, 32) == (1, 32)
