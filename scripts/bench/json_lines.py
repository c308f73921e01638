"""The JSON rows a benchmark printed: every line of its output that is a JSON object.

Benchmarks and workers print their results as one JSON object per line among human-readable
lines (tables, ``#`` comments); the drivers and the plot scripts read them back with
:func:`json_rows`.
"""
from __future__ import annotations

import json


def json_rows(text: str | None) -> list[dict]:
    """The JSON objects among the lines of ``text``, in order.

    Args:
        text: a program's output (None: nothing).
    Returns:
        One dict per line that starts with ``{`` and parses; other lines, and lines cut short
        (a worker killed mid-line), are skipped.
    """
    rows = []
    for line in (text or "").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows
