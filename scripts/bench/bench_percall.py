"""Per-call cost of small batches: what SB3, CleanRL and most DQN/SAC loops pay per sample and per step.

One-step CartPole-like transitions (obs and next_obs float32[4], action int64[1], reward, done, timeout
float32), N of them held. Rows, each timed in the same run, interleaved (rounds of ``CALLS`` consecutive
calls per case, in turn; best and median of the rounds, per call):

  sample B           Shard.sample(B, window=1) into a new batch, squeezed (sample(..., squeeze=True)), into
                     a reused batch (out=); a one-rank Replay.sample(B, window=1); gear_mpi's SB3 adapter
                     GearReplayBuffer.sample(B); SB3's ReplayBuffer.sample(B); cpprb's ReplayBuffer.sample(B)
  sample+update B    prioritized: Shard(Prioritized).sample(B, 1) + update_priorities, the SB3 adapter's
                     prioritized buffer (sample + update_priorities) and cpprb's PrioritizedReplayBuffer
                     (SB3 has no prioritized buffer); the same with every column then read as a torch
                     tensor (``+ columns to torch``: the five columns cpprb holds and the weights; ``batch[name]``
                     for gear_mpi, whose tensors are made at their first read, ``torch.from_numpy`` of
                     cpprb's arrays), what a torch training loop pays
  add one step       Shard.insert_packed of one one-step item, Shard.append_step (the one-step path),
                     GearReplayBuffer.add, SB3's add, cpprb's add

A library that is missing (stable-baselines3, cpprb) leaves its rows out. Run as a section of bench_shard
(``python -m scripts.bench.bench_shard --sections percall``) or alone
(``python -m scripts.bench.bench_percall [--quick]``).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import gear_mpi as gm

OBS = 4
SPEC = gm.TrajectorySpec({"obs": ((OBS,), "float32"), "next_obs": ((OBS,), "float32"), "action": ((1,), "int64"),
                          "reward": ((1,), "float32"), "done": ((1,), "float32"), "timeout": ((1,), "float32")},
                         max_length=1)
CALLS = 50  # consecutive calls per timed round


def per_call(fns: dict, rounds: int, calls: int = CALLS) -> dict[str, list[float]]:
    """Seconds per call of each function: ``rounds`` rounds of ``calls`` consecutive calls, the functions
    taking turns round by round (so that they share the machine's noise)."""
    for fn in fns.values():
        for _ in range(calls):
            fn()
    out = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            out[k].append((time.perf_counter() - t) / calls)
    return out


def _from_numpy():
    import torch
    return torch.from_numpy


def transitions(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"obs": rng.standard_normal((n, OBS)).astype(np.float32),
            "next_obs": rng.standard_normal((n, OBS)).astype(np.float32),
            "action": rng.integers(0, 2, (n, 1)), "reward": np.ones((n, 1), np.float32),
            "done": (rng.random((n, 1)) < 0.05).astype(np.float32), "timeout": np.zeros((n, 1), np.float32)}


def fill_shard(shard, data: dict, n: int) -> None:
    for lo in range(0, n, 65536):
        hi = min(n, lo + 65536)
        shard.insert_packed({k: v[lo:hi] for k, v in data.items()}, np.ones(hi - lo, np.int64))


def sb3_buffers(n: int, data: dict):
    """SB3's ReplayBuffer and gear_mpi's adapter (uniform and prioritized), each holding ``n`` transitions."""
    try:
        from gymnasium import spaces
        from stable_baselines3.common.buffers import ReplayBuffer
        from gear_mpi.integrations import sb3 as gsb3
    except ImportError:
        return None
    obs_space, act_space = spaces.Box(-10, 10, (OBS,), np.float32), spaces.Discrete(2)
    bufs = {"sb3": ReplayBuffer(n, obs_space, act_space, device="cpu"),
            "gear": gsb3.GearReplayBuffer(n, obs_space, act_space, device="cpu", seed=0),
            "gear_per": gsb3.GearPrioritizedReplayBuffer(n, obs_space, act_space, device="cpu", seed=0)}
    infos = [{}]
    for i in range(n):
        args = (data["obs"][i:i + 1], data["next_obs"][i:i + 1], data["action"][i], data["reward"][i],
                data["done"][i], infos)
        for b in bufs.values():
            b.add(*args)
    return bufs


def cpprb_buffers(n: int, data: dict):
    try:
        import cpprb
    except ImportError:
        return None
    env = {"obs": {"shape": OBS}, "next_obs": {"shape": OBS}, "act": {"shape": 1, "dtype": np.int64}, "rew": {},
           "done": {}}
    plain, per = cpprb.ReplayBuffer(n, env), cpprb.PrioritizedReplayBuffer(n, env, alpha=0.6)
    for b in (plain, per):
        b.add(obs=data["obs"], next_obs=data["next_obs"], act=data["action"], rew=data["reward"], done=data["done"])
    return plain, per


def bench_percall(n: int, batch_sizes=(32, 64, 256), rounds: int = 30, use_cpprb: bool = True,
                  use_sb3: bool = True) -> list[dict]:
    """The rows of the module docstring, as dicts: case, B, N, us (best per call), med_us."""
    data = transitions(n)
    shard = gm.Shard(SPEC, n, gm.Uniform(), seed=0)
    pshard = gm.Shard(SPEC, n, gm.Prioritized(0.6, 0.4), seed=0)
    replay = gm.Replay(SPEC, n, gm.Uniform(), seed=0)
    for s in (shard, pshard, replay):
        fill_shard(s, data, n)
    sb3 = sb3_buffers(n, data) if use_sb3 else None
    cp = cpprb_buffers(n, data) if use_cpprb else None
    rows = []
    for b in batch_sizes:
        out = shard.sample(b, 1)
        prio = np.random.default_rng(1).random(b) + 0.1
        fns = {"Shard.sample(B, 1), new batch": lambda: shard.sample(b, 1),
               "Shard.sample(B, 1, squeeze=True)": lambda: shard.sample(b, 1, squeeze=True),
               "Shard.sample(B, 1, out=batch)": lambda: shard.sample(b, 1, out=out),
               "Replay.sample(B, 1), 1 rank": lambda: replay.sample(b, 1)}
        if sb3:
            fns["GearReplayBuffer.sample(B)"] = lambda: sb3["gear"].sample(b)
            fns["SB3 ReplayBuffer.sample(B)"] = lambda: sb3["sb3"].sample(b)
        if cp:
            fns["cpprb ReplayBuffer.sample(B)"] = lambda: cp[0].sample(b)

        def shard_per():
            batch = pshard.sample(b, 1)
            pshard.update_priorities(batch.keys, prio)
        fns["Shard(Prioritized) sample+update"] = shard_per
        if sb3:
            def adapter_per():
                s = sb3["gear_per"].sample(b)
                sb3["gear_per"].update_priorities(s.keys, prio)
            fns["GearPrioritizedReplayBuffer sample+update"] = adapter_per
        names = ("obs", "next_obs", "action", "reward", "done")  # cpprb's five columns (it holds no timeout)

        def shard_per_torch():
            batch = pshard.sample(b, 1)
            pshard.update_priorities(batch.keys, prio)
            for name in names:
                batch[name]
            batch.weights
        fns["Shard(Prioritized) sample+update + columns to torch"] = shard_per_torch
        if cp:
            def cpprb_per():
                s = cp[1].sample(b, beta=0.4)
                cp[1].update_priorities(s["indexes"], prio)
            fns["cpprb PrioritizedReplayBuffer sample+update"] = cpprb_per
            from_numpy = _from_numpy()
            cp_names = ("obs", "next_obs", "act", "rew", "done")

            def cpprb_per_torch():
                s = cp[1].sample(b, beta=0.4)
                cp[1].update_priorities(s["indexes"], prio)
                for name in cp_names:
                    from_numpy(s[name])
                from_numpy(s["weights"])
            fns["cpprb PrioritizedReplayBuffer sample+update + columns to torch"] = cpprb_per_torch
        times = per_call(fns, rounds)
        rows += [{"case": k, "B": b, "N": n, "us": 1e6 * min(v), "med_us": 1e6 * float(np.median(v))}
                 for k, v in times.items()]
    one = {k: v[:1] for k, v in data.items()}
    ones = np.ones(1, np.int64)
    fns = {"Shard.insert_packed(1 step)": lambda: shard.insert_packed(one, ones)}
    if hasattr(shard, "append_step"):  # issue 34's append path for one step
        step = {k: v[0] for k, v in data.items()}
        fns["Shard.append_step(step)"] = lambda: shard.append_step(step)
    if sb3:
        args = (data["obs"][:1], data["next_obs"][:1], data["action"][0], data["reward"][0], data["done"][0], [{}])
        fns["GearReplayBuffer.add"] = lambda: sb3["gear"].add(*args)
        fns["SB3 ReplayBuffer.add"] = lambda: sb3["sb3"].add(*args)
    if cp:
        kw = dict(obs=data["obs"][0], next_obs=data["next_obs"][0], act=data["action"][0], rew=data["reward"][0, 0],
                  done=data["done"][0, 0])
        fns["cpprb ReplayBuffer.add"] = lambda: cp[0].add(**kw)
    times = per_call(fns, rounds, calls=4 * CALLS)
    rows += [{"case": k, "B": 1, "N": n, "us": 1e6 * min(v), "med_us": 1e6 * float(np.median(v))}
             for k, v in times.items()]
    for s in (shard, pshard):
        s.close()
    replay.close()
    if sb3:
        sb3["gear"].close()
        sb3["gear_per"].close()
    return rows


def targets(rows: list[dict]) -> list[tuple[str, float, bool]]:
    """Issue 34's per-call targets on these rows: (target, value, met)."""
    by = {(r["case"], r["B"]): r["us"] for r in rows}
    out = []
    sb3 = by.get(("SB3 ReplayBuffer.sample(B)", 64))
    if sb3:
        v = by[("Shard.sample(B, 1), new batch", 64)] / sb3
        out.append(("Shard.sample(64, 1), new batch / SB3 ReplayBuffer.sample(64) <= 1", v, v <= 1))
        v = by[("GearReplayBuffer.sample(B)", 64)] / sb3
        out.append(("GearReplayBuffer.sample(64) / SB3 ReplayBuffer.sample(64) <= 1", v, v <= 1))
        v = by[("GearReplayBuffer.add", 1)] / by[("SB3 ReplayBuffer.add", 1)]
        out.append(("GearReplayBuffer.add / SB3 ReplayBuffer.add <= 2", v, v <= 2))
        if ("Shard.append_step(step)", 1) in by:
            v = by[("Shard.append_step(step)", 1)] / by[("SB3 ReplayBuffer.add", 1)]
            out.append(("Shard.append_step / SB3 ReplayBuffer.add <= 2", v, v <= 2))
    for b in (32, 64):
        cp = by.get(("cpprb PrioritizedReplayBuffer sample+update", b))
        if cp and ("Shard(Prioritized) sample+update", b) in by:
            v = by[("Shard(Prioritized) sample+update", b)] / cp
            out.append((f"Shard(Prioritized) sample+update({b}) / cpprb's <= 1", v, v <= 1))
    v = by[("Replay.sample(B, 1), 1 rank", 64)] / by[("Shard.sample(B, 1), new batch", 64)]
    out.append(("one-rank Replay.sample(64, 1) / Shard.sample(64, 1) <= 1.5", v, v <= 1.5))
    return out


def torch_ratios(rows: list[dict]) -> list[tuple[str, float]]:
    """Information beside the targets: gear_mpi's prioritized step with every column read as a tensor over
    cpprb's with ``torch.from_numpy`` of its arrays (the same five columns and the weights)."""
    by = {(r["case"], r["B"]): r["us"] for r in rows}
    out = []
    for b in (32, 64):
        cp = by.get(("cpprb PrioritizedReplayBuffer sample+update + columns to torch", b))
        mine = by.get(("Shard(Prioritized) sample+update + columns to torch", b))
        if cp and mine:
            out.append((f"Shard(Prioritized) sample+update({b}) + columns to torch / cpprb's", mine / cp))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N=1e4 transitions, fewer rounds")
    ap.add_argument("--n", type=int, default=None, help="transitions held (default 1e5; 1e4 with --quick)")
    args = ap.parse_args(argv)
    n = args.n or (10_000 if args.quick else 100_000)
    rows = bench_percall(n, rounds=10 if args.quick else 30)
    print(f"# per-call cost, N={n} one-step transitions; us per call (best of rounds of {CALLS} calls; med = median)")
    for r in rows:
        print(f"{r['case']:>45}  B={r['B']:<4d} {r['us']:8.1f} us  (med {r['med_us']:.1f})")
    for t, v, ok in targets(rows):
        print(f"# target: {t}: {v:.2f} {'met' if ok else 'NOT met'}")
    for t, v in torch_ratios(rows):
        print(f"# information: {t}: {v:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
