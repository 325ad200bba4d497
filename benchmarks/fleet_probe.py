"""What the fleet benchmarks read off a running plane: each process's CPU and RSS from /proc, its services' pids
from `ballast up`'s state file, and the hosts by state with their heartbeat lag from the store's tables."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

SERVICES = ("planner", "store", "store-read")


@dataclass(frozen=True)
class Sample:
    at: float
    cpu_s: dict[str, float]
    rss_mb: dict[str, float]


def usage(pids: dict[str, int]) -> Sample:
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    cpu, rss = {}, {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except OSError:
            continue
        cpu[name] = (int(fields[11]) + int(fields[12])) / tick
        rss[name] = pages * page / 2**20
    return Sample(time.monotonic(), cpu, rss)


def per_minute(before: Sample, after: Sample, name: str) -> float:
    return (after.cpu_s.get(name, 0.0) - before.cpu_s.get(name, 0.0)) * 60.0 / (after.at - before.at)


def plane_pids(data_dir: Path, names: tuple[str, ...] = SERVICES) -> dict[str, int]:
    state = json.loads((data_dir / "run" / "state.json").read_text())
    return {c["name"]: c["pid"] for c in state["children"] if c["name"] in names}


def hosts_by_state(engine: sa.Engine) -> tuple[dict[str, int], list[float]]:
    """(hosts per state, each ONLINE host's heartbeat lag in seconds by the database's clock)."""
    with engine.connect() as conn:
        states = dict(conn.execute(sa.text("SELECT state, count(*) FROM hosts GROUP BY state")).all())
        beats = conn.execute(sa.text("SELECT last_heartbeat_at FROM hosts WHERE state = 'HOST_STATE_ONLINE'"))
        now = time.time()
        lags = [max(0.0, now - epoch(at)) for (at,) in beats if at is not None]
    return {k.removeprefix("HOST_STATE_"): v for k, v in states.items()}, lags


def epoch(value) -> float:
    if isinstance(value, str):  # SQLite hands the text back
        from datetime import UTC, datetime

        parsed = datetime.fromisoformat(value)
        return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()
    return value.timestamp()
