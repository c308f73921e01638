"""The median timer the issue-34 probe scripts share (docs/benchmarks/issue34_*.py)."""
import time

import numpy as np


def median_time(fn, seconds: float, min_calls: int = 1) -> float:
    """The median seconds of one ``fn()`` over calls repeated for ``seconds`` (at least ``min_calls``)."""
    ts = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(ts) < min_calls:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))
