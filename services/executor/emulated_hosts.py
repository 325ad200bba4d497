"""Emulated hosts (issue 43): N executor agents in one process, each a real agent to the plane.

Each host has its own name (`<prefix>-00042`), a distinct loopback address (127.a.b.c: distinct machines to the
planner's host classes and placements), its mTLS identity, its Connect stream, registration, heartbeats and
instructions, exactly as a real agent's; its workers are `emulated.EmulatedRank`s. `ballast serve executor
--emulate N` runs this; benchmarks and tests drive faults through `EmulatedHosts` (lose a host, kill a rank,
slow a host down).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

from ballast.config import Settings
from ballast.v1 import fleet_pb2
from services.executor.agent import Agent, Emulated
from services.executor.emulated import Behaviour, Emulator
from services.specs import catalog

log = logging.getLogger("ballast.emulated")


def address(index: int) -> str:
    """Host `index`'s loopback address: 127.1.0.1 onwards (127.0.0.0/16 stays the machine's own)."""
    n = index + 1
    return f"127.{1 + n // 65536}.{(n // 256) % 256}.{n % 256}"


class EmulatedHosts:
    """`count` agents of `devices_per_host` devices of catalog kind `device_kind`, sharing one emulator."""

    def __init__(self, settings: Settings, count: int, devices_per_host: int = 8,
                 device_kind: str = "nvidia-h100-sxm-80gb", behaviour: Behaviour | None = None,
                 prefix: str = "emu", first: int = 0) -> None:
        spec = catalog.to_proto(catalog.device(device_kind))
        self.emulator = Emulator(behaviour)
        self.agents: list[Agent] = []
        for i in range(first, first + count):
            name = f"{prefix}-{i:05d}"
            devices = [fleet_pb2.Device(index=d, spec=spec, uuid=f"{name}-dev{d}") for d in range(devices_per_host)]
            self.agents.append(Agent(settings, name, settings.executor_port + i,
                                     Emulated(devices, address(i), self.emulator.launcher(name))))

    def start(self) -> None:
        """Every agent's control stream on one event loop (a coroutine each, not threads)."""
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="emulated-agents", daemon=True).start()
        for agent in self.agents:
            agent.start(self.loop)

    def stop(self) -> None:
        for agent in self.agents:
            agent.stop()

    def registered(self) -> int:
        """How many hosts the planner has accepted."""
        return sum(1 for a in self.agents if a.host_id)

    def straggle(self, name: str, factor: float) -> None:
        """Host `name` runs `factor` times slower from its next iteration on (1.0: back to normal); a job's
        iteration lasts as long as its slowest host's."""
        self.emulator.behaviour.slow[name] = factor

    def lose(self, name: str) -> int:
        """Host `name` is gone: its stream drops and its workers vanish. Returns how many workers it ran."""
        agent = next(a for a in self.agents if a.name == name)
        agent.vanish()
        return self.emulator.lose_host(name)


def main(settings: Settings, count: int, devices_per_host: int, device_kind: str, behaviour: Behaviour,
         first: int = 0) -> int:
    hosts = EmulatedHosts(settings, count, devices_per_host, device_kind, behaviour, first=first)
    hosts.start()
    log.info("emulating hosts", extra={"hosts": count, "first": first, "devices_per_host": devices_per_host,
                                       "kind": device_kind})
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: done.set())
    done.wait()
    hosts.stop()
    return 0
