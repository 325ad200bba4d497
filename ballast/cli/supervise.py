"""`ballast supervise`: keeps the embedded plane's processes running, as compose's `restart:` does in production.

`ballast up` starts it last and `ballast down` stops it first. A child that dies is started again with the same
command after a backoff that doubles with each death in a row (1 s, 2 s, 4 s ... at most 60 s; a child that then
runs HEALTHY_S is forgiven its earlier deaths), and its restarts are counted in <data-dir>/run/state.json, which
`ballast status` shows and the store's metrics export (ballast_component_restarts).
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import UTC, datetime

from ballast.cli.control_plane import State, alive, spawn
from ballast.config import Settings

TICK_S = 0.5
MAX_BACKOFF_S = 60.0
HEALTHY_S = 60.0


class Supervisor:
    """One pass at a time (`tick`), so a test can drive it; `run` ticks until stopped or the state is gone."""

    def __init__(self, settings: Settings, clock=time.monotonic):
        self.settings, self.clock = settings, clock
        self.deaths: dict[str, int] = {}  # deaths in a row, by child name
        self.due: dict[str, float] = {}  # when a dead child starts again
        self.started: dict[str, float] = {}  # when the supervisor last started it

    def tick(self) -> bool:
        """Restart what is due; False when there is no plane to supervise any more."""
        state = State.load(self.settings)
        if state is None:
            return False
        now, changed = self.clock(), False
        for child in state.children:
            if alive(child.pid):
                if now - self.started.get(child.name, -HEALTHY_S) >= HEALTHY_S:
                    self.deaths.pop(child.name, None)
                continue
            if child.name not in self.due:  # just found dead
                self.deaths[child.name] = self.deaths.get(child.name, 0) + 1
                self.due[child.name] = now + min(MAX_BACKOFF_S, 2.0 ** (self.deaths[child.name] - 1))
                child.last_exit = f"found exited at {datetime.now(UTC).isoformat(timespec='seconds')}"
                changed = True
            elif now >= self.due[child.name] and child.args:
                child.pid = spawn(self.settings, child.name, child.args, child.env).pid
                child.restarts += 1
                self.started[child.name] = now
                del self.due[child.name]
                changed = True
        if changed:
            state.save(self.settings)
        return True

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set() and self.tick():
            stop.wait(TICK_S)


def run_supervisor(settings: Settings) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    Supervisor(settings).run(stop)
    return 0
