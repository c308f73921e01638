"""What a replay reports about itself: the figures of ``stats()``, activity counters and rates.

Two kinds of figures, one module. **State** (what the shards hold):

A shard reports its own figures flat, under the names of :data:`SHARD_FIGURES`
(and its ``rank``). A replay reports, for every figure of :data:`REPLAY_FIGURES`
(the shard's plus the window counters of the replay's transport), one list
indexed by rank under ``"per_rank"`` and the sum over the ranks under
``"total"``, beside ``"ranks"``, ``"mode"`` and ``"balance"``. The table of
docs/guide/statistics.md lists every key; this module is the code of it (local, no
communication: the replay gathers the rows, then calls :func:`combine`).

**Activity** (how fast the replay works):

Every rank of a Replay counts, from its construction on (:class:`ReplayActivity`, a part of
:class:`~gear_mpi.replay.Replay`), the figures of :data:`ACTIVITY_FIGURES`: items and bytes
inserted (every path: ``insert``, writers, actor ranks), windows served from its shard, windows
and bytes its samples received, and where its time went -- inside ``sample`` (of it: waiting in
collectives, copying windows), inside ``update_priorities``, and waiting in any collective of the
replay. The counting costs a few ``time.perf_counter`` calls per sample, update and collective.

``replay.stats()["activity"]`` gathers them (``{"per_rank": {figure: [...]}, "total": {...}}``,
``uptime`` totalled as the largest); :func:`rates` turns two snapshots into rates::

    before = replay.stats()            # collective: every rank calls it
    ...                                # train
    r = gm.rates(before, replay.stats())
    r["total"]["samples_per_s"], r["per_rank"]["wait_fraction"]

A training loop that wants them every so often uses a :class:`RateMeter` (``gm.log_every(replay,
seconds)`` prints a line): its ``step()`` is called by **every** rank once per training step
(a collective in effect), and only some steps gather a snapshot. Which ones is decided alike on
every rank without any extra message: every ``every`` steps, or -- for ``seconds=`` -- from
the steps per second measured on rank 0's clock, whose uptime is part of each gathered snapshot.
The meter gathers over its own duplicate of the replay's communicator, so it also works while a
``replay.batches()`` iterator samples on its thread. Feed loggers from its sink (no dependency)::

    meter = gm.RateMeter(replay, seconds=30, sink=wandb.log)                      # W&B
    meter = gm.RateMeter(replay, every=500, sink=lambda m: [tb.add_scalar(k, v, m["step"]) for k, v in m.items()])

The counters are not checkpointed: a loaded replay counts from zero.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .distributed.comm import MpiComm
from .kernels import ring
from .spec import whole_number

#: figures of one shard, in the order a replay gathers them; "weight" is a float, the rest are ints
SHARD_FIGURES = ("items", "live_steps", "steps_used", "capacity_steps", "weight", "inserted", "evicted", "removed",
                 "sampled", "stale_updates", "stored_bytes", "raw_bytes", "reserved_bytes")
#: figures of one rank of a replay: the shard's, then the windows this rank received by each path, then its feeds
REPLAY_FIGURES = SHARD_FIGURES + ("windows_shared", "windows_mpi", "ingested", "writers", "staged", "staged_steps",
                                  "writers_draining", "ingested_age")
_FLOAT = frozenset({"weight", "ingested_age"})
#: figures whose total is the largest rank's finite value (``inf``, "none", when no rank has one), not the sum:
#: an age, ``inf`` on a rank that has ingested nothing from a writer
LARGEST = frozenset({"ingested_age"})


def _largest(values: Sequence[float]) -> float:
    """The largest finite value of ``values`` (``inf`` when none is finite)."""
    known = [v for v in values if math.isfinite(v)]
    return max(known) if known else math.inf


def _cast(name: str, value: float) -> float | int:
    return float(value) if name in _FLOAT else int(value)


def row(figures: Mapping[str, Any], names: Sequence[str] = REPLAY_FIGURES) -> list[float]:
    """One rank's figures as numbers in gather order (local, O(figures)).

    Args:
        figures: name -> value, with every name of ``names``.
        names: the figure names, in order.
    Returns:
        The values as floats (exact for integers below 2**53).
    Raises:
        KeyError: a figure is missing.
    """
    return [float(figures[k]) for k in names]


def combine(table: np.ndarray, mode: str, names: Sequence[str] = REPLAY_FIGURES) -> dict[str, Any]:
    """A replay's statistics from every rank's :func:`row` (local, O(ranks * figures)).

    Args:
        table: ``[ranks, len(names)]`` float64, row r from rank r.
        mode: the replay's default sampling mode.
        names: the figure names of the table's columns.
    Returns:
        ``{"ranks": P, "mode": mode, "balance": largest shard / mean shard in items (1.0 when empty),
        "total": {figure: sum over ranks (for :data:`LARGEST`: the largest)}, "per_rank": {figure: [value of
        rank r, ...]}}``.
    """
    per_rank = {k: [_cast(k, v) for v in table[:, i].tolist()] for i, k in enumerate(names)}
    total = {k: _cast(k, (_largest if k in LARGEST else sum)(table[:, i].tolist())) for i, k in enumerate(names)}
    items = table[:, names.index("items")] if "items" in names else np.zeros(1)
    balance = float(items.max() / items.mean()) if items.sum() else 1.0
    return {"ranks": int(table.shape[0]), "mode": mode, "balance": balance, "total": total, "per_rank": per_rank}


#: one rank's activity counters, in gather order (cumulative since the replay was built on that rank), then
#: its gauges (:data:`ACTIVITY_GAUGES`)
ACTIVITY_COUNTERS = ("uptime", "inserted", "inserted_bytes", "served", "received", "received_bytes", "sample_calls",
                     "sample_seconds", "sample_wait_seconds", "copy_seconds", "update_calls", "update_seconds",
                     "wait_seconds")
#: figures of now, not cumulative: episodes and steps staged in the rank's writers (ended, not ingested) and the
#: age in seconds of the newest ingested step (``inf`` before any), as last counted at its collectives
ACTIVITY_GAUGES = ("staged", "staged_steps", "ingested_age")
ACTIVITY_FIGURES = ACTIVITY_COUNTERS + ACTIVITY_GAUGES
_COUNTS = frozenset({"inserted", "inserted_bytes", "served", "received", "received_bytes", "sample_calls",
                     "update_calls", "staged", "staged_steps"})


@dataclass
class Activity:
    """The counters a replay keeps itself (the rest are read from its shard, communicator and transport)."""
    born: float = field(default_factory=time.perf_counter)
    step_bytes: int = 0  # a window step's bytes in a batch: the columns' and the mask's
    received: int = 0
    received_bytes: int = 0
    sample_calls: int = 0
    sample_seconds: float = 0.0
    sample_wait_seconds: float = 0.0
    update_calls: int = 0
    update_seconds: float = 0.0


class ReplayActivity:
    """The activity counters of one rank of a Replay: the part that :func:`metered_sample` and
    :func:`metered_update` count into, and that :meth:`row` reads with the shard's, communicator's and
    transport's own counters. Local.

    Args:
        shard: this rank's shard (items and bytes inserted, windows served).
        comm: the replay's :class:`~gear_mpi.distributed.comm.MpiComm` (time waiting in collectives).
        transport: the replay's window transport (time copying windows: its ``copy_seconds``).
        step_bytes: a window step's bytes in a batch (the columns' and the mask's).
        feeds: the replay's :class:`~gear_mpi.feeds.replay_feeds.ReplayFeeds` (its ``gauges()``), or None.
    """

    def __init__(self, shard, comm: MpiComm, transport, step_bytes: int, feeds=None):
        self.shard, self.comm, self.transport, self.feeds = shard, comm, transport, feeds
        self.counts = Activity(step_bytes=step_bytes)

    def row(self) -> list[float]:
        """This rank's counters in :data:`ACTIVITY_FIGURES` order (local, O(1); safe from any thread: it only
        reads numbers).

        Returns:
            The values as floats.
        """
        a, s = self.counts, self.shard
        gauges = self.feeds.gauges() if self.feeds is not None else [0.0, 0.0, math.inf]
        return [time.perf_counter() - a.born, float(s.store.state[ring.INSERTED_TOTAL]), float(s.bytes_inserted),
                float(s.samples_drawn), float(a.received), float(a.received_bytes), float(a.sample_calls),
                a.sample_seconds, a.sample_wait_seconds, self.transport.copy_seconds, float(a.update_calls),
                a.update_seconds, self.comm.waited, *gauges]

    def count_sample(self, start: float, waited: float, batch) -> None:
        """Count one sample call begun at ``start`` (``time.perf_counter``) when the communicator had waited
        ``waited`` seconds, and the rows and bytes of its ``batch`` (None: the call raised)."""
        a = self.counts
        a.sample_calls += 1
        a.sample_seconds += time.perf_counter() - start
        a.sample_wait_seconds += self.comm.waited - waited
        if batch is not None:
            rows = batch.batch_size  # bytes as Batch.nbytes counts them: columns and mask per step, 28 B of metadata
            a.received += rows
            a.received_bytes += rows * (batch.window * a.step_bytes + 28)

    def count_update(self, start: float) -> None:
        """Count one priority update begun at ``start`` (``time.perf_counter``)."""
        a = self.counts
        a.update_calls += 1
        a.update_seconds += time.perf_counter() - start


def metered_sample(method: Callable) -> Callable:
    """Wrap ``Replay.sample``: the replay's activity part (``replay._activity``, a :class:`ReplayActivity`)
    counts the call, its time, its time waiting in collectives, its rows and bytes."""
    @functools.wraps(method)
    def sample(self, *args, **kwargs):
        activity = self._activity
        start, waited, batch = time.perf_counter(), activity.comm.waited, None
        try:
            batch = method(self, *args, **kwargs)
            return batch
        finally:
            activity.count_sample(start, waited, batch)
    return sample


def metered_update(method: Callable) -> Callable:
    """Wrap ``Replay.update_priorities``: the replay's activity part (``replay._activity``, a
    :class:`ReplayActivity`) counts the call and its time."""
    @functools.wraps(method)
    def update_priorities(self, *args, **kwargs):
        activity, start = self._activity, time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            activity.count_update(start)
    return update_priorities


def combine_activity(table: np.ndarray) -> dict[str, dict[str, Any]]:
    """Every rank's :meth:`ReplayActivity.row` (``Replay.activity_row``) as ``{"per_rank": {figure: [...]},
    "total": {...}}`` (local). Totals are sums, except ``uptime`` and ``ingested_age``: the largest (finite) one.

    Args:
        table: ``[ranks, len(ACTIVITY_FIGURES)]``, row r from rank r.
    """
    def cast(k, v):
        return int(v) if k in _COUNTS else float(v)
    per_rank = {k: [cast(k, v) for v in table[:, i].tolist()] for i, k in enumerate(ACTIVITY_FIGURES)}
    total = {k: cast(k, _largest(table[:, i].tolist()) if k in ("uptime", "ingested_age") else table[:, i].sum())
             for i, k in enumerate(ACTIVITY_FIGURES)}
    return {"per_rank": per_rank, "total": total}


def rates(before: dict, after: dict) -> dict[str, Any]:
    """Rates between two activity snapshots of one replay (local, O(ranks)).

    Args:
        before, after: two ``replay.stats()`` results (or their ``"activity"`` parts, or
            :meth:`RateMeter.snapshot` results), ``after`` the later.
    Returns:
        ``{"seconds": the interval (the longest rank's), "ranks": P, "total": {rate: value},
        "per_rank": {rate: [value of rank r, ...]}}`` with the rates ``inserts_per_s``,
        ``insert_bytes_per_s``, ``samples_per_s`` (windows received), ``sample_bytes_per_s``, ``served_per_s``
        (windows served from the rank's shard), ``sample_calls_per_s``, ``updates_per_s`` (calls), the shares
        of wall time ``sample_fraction``, ``sample_wait_fraction`` and ``copy_fraction`` (parts of it:
        waiting in the sample's collectives; packing and copying windows), ``sample_other_fraction`` (the
        rest of it: selection, the rate limiter's back-off, the node fence), ``update_fraction``,
        ``wait_fraction`` (waiting in any collective of the replay), and ``sample_ms`` (mean time of a
        sample call; NaN without calls). Totals: rates summed over ranks (per second of the interval),
        fractions averaged, ``sample_ms`` over every call. Also the gauges of ``after``
        (:data:`ACTIVITY_GAUGES`: ``staged``, ``staged_steps`` summed, ``ingested_age`` the largest rank's),
        when it has them.
    Raises:
        ValueError: snapshots of different rank counts, or ``after`` not later than ``before`` on a rank.
    """
    b, a = before.get("activity", before)["per_rank"], after.get("activity", after)["per_rank"]
    if len(a["uptime"]) != len(b["uptime"]):
        raise ValueError("rates: the snapshots come from replays of different rank counts")
    d = {k: np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64) for k in ACTIVITY_COUNTERS}
    dt = d["uptime"]
    if (dt <= 0).any():
        raise ValueError("rates: `after` must be a later snapshot of the same replay than `before`")
    span = float(dt.max())
    per_s = {"inserts_per_s": "inserted", "insert_bytes_per_s": "inserted_bytes", "samples_per_s": "received",
             "sample_bytes_per_s": "received_bytes", "served_per_s": "served", "sample_calls_per_s": "sample_calls",
             "updates_per_s": "update_calls"}
    shares = {"sample_fraction": d["sample_seconds"], "sample_wait_fraction": d["sample_wait_seconds"],
              "copy_fraction": d["copy_seconds"],
              "sample_other_fraction": np.maximum(d["sample_seconds"] - d["sample_wait_seconds"] - d["copy_seconds"],
                                                  0.0),
              "update_fraction": d["update_seconds"], "wait_fraction": d["wait_seconds"]}
    per_rank, total = {}, {}
    for name, fig in per_s.items():
        per_rank[name] = (d[fig] / dt).tolist()
        total[name] = float(d[fig].sum() / span)
    for name, seconds in shares.items():
        per_rank[name] = (seconds / dt).tolist()
        total[name] = float((seconds / dt).mean())
    calls = d["sample_calls"]
    with np.errstate(divide="ignore", invalid="ignore"):
        per_rank["sample_ms"] = np.where(calls > 0, 1e3 * d["sample_seconds"] / calls, math.nan).tolist()
    total["sample_ms"] = float(1e3 * d["sample_seconds"].sum() / calls.sum()) if calls.sum() else math.nan
    for name in ACTIVITY_GAUGES:
        if name in a:
            values = [float(v) for v in a[name]]
            per_rank[name] = values
            total[name] = _largest(values) if name == "ingested_age" else float(sum(values))
    return {"seconds": span, "ranks": len(dt), "total": total, "per_rank": per_rank}


def flatten(r: dict, prefix: str = "replay/", per_rank: bool = False) -> dict[str, float]:
    """A :func:`rates` result as one flat ``{name: number}`` dict, as metric loggers take it (local).

    Args:
        r: from :func:`rates`.
        prefix: put before every name.
        per_rank: also ``{prefix}rank{r}/{rate}`` for every rank.
    Returns:
        ``{prefix + "seconds": ..., prefix + rate: total, ...}``.
    """
    out = {f"{prefix}seconds": r["seconds"], **{f"{prefix}{k}": v for k, v in r["total"].items()}}
    if per_rank:
        for k, values in r["per_rank"].items():
            out.update({f"{prefix}rank{i}/{k}": v for i, v in enumerate(values)})
    return out


def describe(r: dict) -> str:
    """One line of text saying what a :func:`rates` result holds (local); with writers, it ends with their
    backlog and the age of the newest ingested step."""
    t = r["total"]
    line = (f"replay, {r['ranks']} ranks, last {r['seconds']:.3g} s: {t['inserts_per_s']:.4g} inserts/s "
            f"({t['insert_bytes_per_s'] / 1e6:.4g} MB/s), {t['samples_per_s']:.4g} windows/s "
            f"({t['sample_bytes_per_s'] / 1e6:.4g} MB/s) in {t['sample_calls_per_s']:.4g} samples/s of "
            f"{t['sample_ms']:.3g} ms; time in sample {100 * t['sample_fraction']:.1f}% (waiting "
            f"{100 * t['sample_wait_fraction']:.1f}%, copying {100 * t['copy_fraction']:.1f}%), in updates "
            f"{100 * t['update_fraction']:.1f}%, waiting in collectives {100 * t['wait_fraction']:.1f}%")
    age = t.get("ingested_age", math.inf)
    if t.get("staged") or math.isfinite(age):
        line += (f"; staged {int(t.get('staged', 0))} episodes ({int(t.get('staged_steps', 0))} steps), newest "
                 f"ingested step {age:.3g} s old")
    return line


class RateMeter:
    """Rates of a replay every ``every`` steps or about every ``seconds``, for a training loop (module docstring).

    Construction is collective (every rank of the replay, with the same schedule arguments).
    Args:
        replay: the :class:`~gear_mpi.Replay`.
        every: gather a snapshot every this many :meth:`step` calls; or
        seconds: about every this many seconds of rank 0's clock (one of the two).
        sink: called with ``flatten(rates, prefix, per_rank)`` plus ``"step"`` at each report (e.g.
            ``wandb.log``); log: called with :func:`describe`'s line (e.g. ``print``).
        root: the rank whose sink and log are called (None: every rank).
        prefix, per_rank: as :func:`flatten`.
    Raises:
        ValueError: not exactly one of every/seconds, a bad value, or ``every``, ``seconds`` or ``root`` that
            differ between ranks: on every rank (agreed in the head). CollectiveTimeoutError: as the replay.
        RuntimeError: the replay is closed.
        CollectiveError: another rank is in another call of the replay (:mod:`gear_mpi.distributed.calls`).
    Cost: a head of the replay's (as a barrier) and a ``Dup`` of its communicator; per snapshot one allgather of
    16 float64 a rank.
    """

    def __init__(self, replay, *, every: int | None = None, seconds: float | None = None,
                 sink: Callable[[dict], Any] | None = None, log: Callable[[str], Any] | None = None,
                 root: int | None = 0, prefix: str = "replay/", per_rank: bool = False):
        if replay.closed:  # closed on every rank (close is collective): nothing to agree, no communicator to Dup
            raise RuntimeError("RateMeter: the replay is closed")
        err = None
        try:
            if (every is None) == (seconds is None):
                raise ValueError("RateMeter: give exactly one of every= (steps) and seconds=")
            if every is not None and not whole_number(every):
                raise ValueError(f"RateMeter: every must be an integer >= 1, got {every!r}")
            if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                        or not 0 < seconds < math.inf):
                raise ValueError(f"RateMeter: seconds must be a positive finite number, got {seconds!r}")
            if root is not None and not (whole_number(root, 0) and root < replay.comm.size):
                raise ValueError(f"RateMeter: root must be None or a rank of the replay, got {root!r}")
        except ValueError as e:
            err, every, seconds, root = e, 1, None, 0
        self.replay, self.every, self.seconds = replay, every, seconds
        self.sink, self.log, self.root, self.prefix, self.per_rank = sink, log, root, prefix, per_rank
        # Dup blocks: every rank is known to be here first (a head of the replay's: checked against its other calls).
        # The head also agrees the arguments: a bad one on any rank raises on every rank; the schedule (every,
        # seconds) and root must be alike, else the snapshots (collectives) would not line up.
        table = replay.calls.agree(err, "RateMeter", [every or 0, seconds or 0.0, -1 if root is None else root])
        if (table != table[0]).any():
            raise ValueError(f"RateMeter: every, seconds and root must be the same on every rank; got every "
                             f"{table[:, 0].astype(int).tolist()}, seconds {table[:, 1].tolist()} and root "
                             f"{table[:, 2].astype(int).tolist()} (0: not given; root -1: None)")
        self._comm = MpiComm(replay.comm.comm.Dup(), replay.comm.timeout)
        self.steps = 0
        self.snapshots = 0  # snapshots gathered so far
        self.last: dict | None = None  # the last rates reported
        self._next = 1  # the step of the next snapshot (the first one is the baseline)
        self._base = self._prev = None  # (step, snapshot) of the report's start, and of the last snapshot

    def snapshot(self) -> dict:
        """Collective over the meter's communicator: every rank's counters (``combine_activity``'s form).

        Raises:
            RuntimeError: the replay or the meter is closed. CollectiveTimeoutError: a rank did not arrive in time.
        """
        if self.replay.closed:
            raise RuntimeError("RateMeter: the replay is closed")
        if self._comm is None:
            raise RuntimeError("RateMeter: this meter is closed (close() freed its communicator)")
        row = np.array(self.replay.activity_row(), np.float64)
        self.snapshots += 1
        return combine_activity(self._comm.allgather(row, "RateMeter.snapshot"))

    def step(self) -> dict | None:
        """Collective in effect: count one training step; on the steps the schedule picks, gather a snapshot
        and, when a report is due, compute it (and call the sink and log on ``root``).

        Returns:
            The :func:`rates` since the last report, on every rank, when one is made; else None.
        Raises:
            As :meth:`snapshot`.
        """
        self.steps += 1
        if self.steps < self._next:
            return None
        snap = self.snapshot()
        report = None
        if self._base is None:
            self._base = (self.steps, snap)
        elif self.every is not None or self._uptime0(snap) - self._uptime0(self._base[1]) >= 0.9 * self.seconds:
            report = rates(self._base[1], snap)
            self._base = (self.steps, snap)
        self._next = self.steps + self._gap(snap)
        self._prev = (self.steps, snap)
        if report is not None:
            self.last = report
            if self.root is None or self.root == self.replay.rank:
                if self.sink is not None:
                    self.sink({**flatten(report, self.prefix, self.per_rank), "step": self.steps})
                if self.log is not None:
                    self.log(describe(report))
        return report

    @staticmethod
    def _uptime0(snap: dict) -> float:
        return snap["per_rank"]["uptime"][0]

    def _gap(self, snap: dict) -> int:
        """Steps to the next snapshot: ``every``; or the steps rank 0 takes in the time left to the report,
        from its last interval's pace (at most 16 times that interval). The same on every rank: it reads only
        the gathered snapshot and step counts."""
        if self.every is not None:
            return int(self.every)
        if self._prev is None:
            return 1
        steps = self.steps - self._prev[0]
        spent = self._uptime0(snap) - self._uptime0(self._prev[1])
        left = self.seconds - (self._uptime0(snap) - self._uptime0(self._base[1]))
        if spent <= 0:
            return 16 * steps
        return int(round(min(max(1.0, left * steps / spent), 16.0 * steps)))  # capped before rounding: never inf

    def close(self) -> None:
        """Free the meter's communicator (local; idempotent)."""
        if self._comm is not None:
            self._comm.free()
            self._comm = None

    def __enter__(self) -> "RateMeter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def log_every(replay, seconds: float = 60.0, log: Callable[[str], Any] = print, *, root: int | None = 0,
              sink: Callable[[dict], Any] | None = None) -> RateMeter:
    """A :class:`RateMeter` that writes a line of rates (:func:`describe`) about every ``seconds``.

    Collective: every rank calls it, then calls ``meter.step()`` once per training step.
    Args:
        replay: the replay. seconds: between reports (rank 0's clock). log: takes the line (on ``root``).
        root: the rank that logs (None: every rank). sink: also given the flat metrics (see RateMeter).
    Returns:
        The meter.
    """
    return RateMeter(replay, seconds=seconds, sink=sink, log=log, root=root)
