"""The run's engine-start record and its summary: every pool start and restart with its kind and
the tests that caused and used it.

`rollout.log.record_engine_start` appends one JSON line per pool start and restart to the file
`$ROLLOUT_ENGINE_STARTS` names, from whichever process started it. The suite adds its own lines to
the same file: which test runs (`test`, from `tests/conftest.py`), the kind of a pool about to
start in the suite's process (`label`), a restart beginning there (`restarting`: its record is
written when it ends, maybe during a later test; both from `tests/integration/conftest.py`), a
shared pool given to a test (`lease`) or shut down instead of handed on (`dropped`, both from
`tests/support/engines.py`). Lines are appended in the order things happen, so a start belongs
to the test that ran last (a restart: when it began), and a pool start to the `label` its process
wrote just before; a start with no label was made in a process the suite started (a CLI or
driver subprocess).
"""

from __future__ import annotations

import json
import os
from typing import Any

from rollout.log import STARTS_ENV

PREFIX = "tests/integration/"


def append(kind: str, **fields: Any) -> None:
    """One line of the record, where the run keeps one."""
    if path := os.environ.get(STARTS_ENV):
        with open(path, "a") as f:  # one short write per line: appends from several processes stay whole
            f.write(json.dumps({"kind": kind, "engines": 0, "seconds": 0, "pid": os.getpid(), **fields}) + "\n")


def _short(test: str | None) -> str:
    return (test or "before any test").removeprefix(PREFIX)


def _engines(n: int) -> str:
    return f"{n} engine" + ("" if n == 1 else "s")


def summary(records: list[dict[str, Any]]) -> list[str]:
    """The summary's lines: the count, then one line per start (kind, seconds, the test that
    caused it, the test files that used a shared pool), then each dropped pool's reason."""
    pools = [r for r in records if r["kind"] == "pool"]
    restarts = [r for r in records if r["kind"] == "restart"]
    seconds = sum(r["seconds"] for r in pools + restarts)
    lines = [
        f"{len(pools)} engine pools ({sum(r['engines'] for r in pools)} engines) and {len(restarts)} engine restarts: "
        f"{len(pools) + len(restarts)} starts, {seconds:.0f} s of start-up"
    ]
    test: str | None = None
    labels: dict[int, str] = {}  # pid -> the kind of the pool that process is starting
    begun: dict[int, list[str | None]] = {}  # pid -> the tests its restarts under way began in
    starts: list[dict[str, Any]] = []
    shared: dict[tuple[str, int], dict[str, Any]] = {}  # (kind, engines) -> its latest start, where leases go
    for r in records:
        if r["kind"] == "test":
            test = r["test"]
        elif r["kind"] == "label":
            labels[r["pid"]] = r["label"]
        elif r["kind"] == "restarting":
            begun.setdefault(r["pid"], []).append(test)
        elif r["kind"] in ("pool", "restart"):
            label = labels.pop(r.get("pid"), None) if r["kind"] == "pool" else None
            by = begun.get(r.get("pid")) if r["kind"] == "restart" else None
            start = {**r, "label": label, "test": by.pop(0) if by else test, "users": []}
            starts.append(start)
            if label is not None:
                shared[label, r["engines"]] = start
        elif r["kind"] == "lease" and (start := shared.get((r["label"], r["count"]))) is not None:
            file = _short(r["test"]).split("::")[0]
            if file not in start["users"]:
                start["users"].append(file)
    for i, s in enumerate(starts, 1):
        if s["kind"] == "restart":
            what = f"restart of {_engines(s['engines'])}"
        else:
            what = f"pool of {_engines(s['engines'])}, " + (s["label"] or "in a subprocess")
        line = f"{i:>2}. {s['seconds']:4.0f} s  {what}: started in {_short(s['test'])}"
        if s["users"]:
            line += f"; shared by {', '.join(s['users'])}"
        lines.append(line)
    lines += [f"shared pool dropped: {r['reason']}" for r in records if r["kind"] == "dropped"]
    return lines
