"""The embedded plane's supervisor (issue 41, item 11): a process that dies is started again with its own command
after a backoff that doubles with each death in a row, and counted; the store's metrics export the counts and
the data dir's free space. Real processes, a fake clock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from ballast.cli.control_plane import Child, State, alive
from ballast.cli.supervise import Supervisor
from services.store.gauges import StoreGauges
from tests.harness import make_settings


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_dead_child_is_started_again_with_a_doubling_backoff(tmp_path) -> None:
    settings = make_settings(tmp_path / "d")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    # `ballast --version`-like: a command that ends at once, so it dies again after each start
    State([Child(name="worker", pid=gone.pid, args=["--help"], env={"X_MARK": "1"})]).save(settings)
    clock = Clock()
    supervisor = Supervisor(settings, clock=clock)
    assert supervisor.tick() and supervisor.due["worker"] == clock.t + 1.0  # found dead: due in 1 s
    assert State.load(settings).children[0].last_exit.startswith("found exited at")
    supervisor.tick()
    assert State.load(settings).children[0].restarts == 0  # not before its time
    clock.t += 1.0
    supervisor.tick()
    child = State.load(settings).children[0]
    assert child.restarts == 1 and child.pid != gone.pid and child.env == {"X_MARK": "1"}
    os.waitpid(child.pid, 0)  # `ballast --help` ends
    supervisor.tick()
    assert supervisor.due["worker"] == clock.t + 2.0  # the second death in a row waits twice as long
    clock.t += 2.0
    supervisor.tick()
    assert State.load(settings).children[0].restarts == 2


def test_a_healthy_child_is_left_alone_and_no_state_ends_the_supervisor(tmp_path) -> None:
    settings = make_settings(tmp_path / "d")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        State([Child(name="store", pid=sleeper.pid, args=["serve", "store"])]).save(settings)
        supervisor = Supervisor(settings, clock=Clock())
        assert supervisor.tick() and State.load(settings).children[0].restarts == 0 and alive(sleeper.pid)
        State.path(settings).unlink()  # `ballast down` removed it
        assert not supervisor.tick()
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()


def test_the_store_exports_restarts_and_free_space(tmp_path) -> None:
    settings = make_settings(tmp_path / "d")
    State([Child(name="worker", pid=1, restarts=3), Child(name="store", pid=1)]).save(settings)
    families = {f.name: f for f in StoreGauges._data_dir_gauges(settings.data_dir)}
    assert {tuple(s.labels.values()): s.value for s in families["ballast_component_restarts"].samples} == {
        ("worker",): 3, ("store",): 0}
    [free] = families["ballast_data_dir_free_bytes"].samples
    assert free.value > 0
