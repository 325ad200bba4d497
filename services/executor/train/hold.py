"""Hold: every rank of a job waits at one iteration boundary they all agree on, and trains on from there once
released. The planner holds a job while its store refuses writes (a full disk): training on would leave iterations,
checkpoints and events unrecorded. A held job keeps its weights and optimizer state in memory, so nothing is lost
or trained twice, and no collective is left open for the process-group timeout to fail.

The agent writes {"command": "hold", "held": true|false, "reason": ...} on the worker's stdin (`Hold.take`). The
hold rides on each path's existing per-boundary agreement (the plan agreement of the stage trainer, the loss-sum
vote of chunk and Harmony modes); while held, the ranks poll with one small MAX all-reduce of [held, stop, drain]
every `POLL_S`, so a release, a stop or a drain reaches every rank at the same poll."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

POLL_S = 0.5

Report = Callable[[dict[str, Any]], None]


def hold_command(held: bool, reason: str = "") -> str:
    """The stdin line that holds (or releases) a worker: what the agent and `run_local` write, `Hold.take` reads."""
    return json.dumps({"command": "hold", "held": held, "reason": reason}) + "\n"


class Hold:
    """This rank's hold flag, set from the stdin command reader, read at iteration boundaries."""

    def __init__(self) -> None:
        self._held = threading.Event()
        self.reason = ""

    def asked(self) -> bool:
        return self._held.is_set()

    def take(self, line: str) -> bool:
        """True if `line` is a hold command (applied here); False leaves it to the plan inbox."""
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            return False
        if not isinstance(raw, dict) or raw.get("command") != "hold":
            return False
        if raw.get("held") is True:
            self.reason = str(raw.get("reason", ""))[:500]
            self._held.set()
        else:
            self._held.clear()
        return True

    def wait(self, done: int, world: int, group: Any, device: torch.device, head: dict[str, Any], report: Report,
             should_stop: Callable[[], bool], should_drain: Callable[[], bool] = lambda: False) -> str:
        """Every rank agreed to hold after iteration `done`: wait here until every rank is released ("release"),
        or any rank is asked to stop ("stop") or drain ("drain"); all ranks return the same answer. The poll is
        an all-reduce over `group` (None: the default group) when `world` > 1; one rank's own flags decide."""
        import torch  # here, not at import: the agent imports this module for `hold_command` alone
        import torch.distributed as dist

        began = time.monotonic()
        report({"event": "held", **head, "iteration": done, "reason": self.reason})
        while True:
            time.sleep(POLL_S)
            flags = torch.tensor([int(self.asked()), int(should_stop()), int(should_drain())], dtype=torch.int64,
                                 device=device)
            if world > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            held, stop, drain = (bool(v) for v in flags.tolist())
            if stop or drain or not held:
                break
        outcome = "stop" if stop else "drain" if drain else "release"
        report({"event": "released", **head, "iteration": done, "held_s": round(time.monotonic() - began, 3),
                "outcome": outcome})
        return outcome
