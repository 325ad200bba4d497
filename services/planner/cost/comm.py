"""Prices of point-to-point transfers and collectives: measured fits first, fleet links otherwise.

Every price is a line ``t = latency + seconds_per_byte * nbytes`` chosen once per
(collective, group size, scope) and cached, so the hot path is one multiply-add. Sources, best first:

1. ``measured``: the profile's calibrated fit for exactly this collective, group size and scope
   (Varuna §4.3 / Table 2: send times and allreduce per ring size measured once, scale-invariant).
2. ``measured, rescaled``: a fit of the same collective and scope at another group size, moved to
   this one by holding its bus bandwidth constant (nccl-tests convention: for ring algorithms the
   bytes each rank moves per second do not depend on n) and scaling latency by the ring's steps.
3. ``from fleet links``: ring formulas on the fleet's Link (bandwidth = one direction, per device):
   allreduce ``2(n-1)/n * B / bw + 2(n-1) * lat``; allgather, reduce-scatter and all-to-all
   ``(n-1)/n * B / bw + (n-1) * lat``; p2p ``lat + B / bw``.

Byte conventions of this module's API (what a caller naturally has in hand):
allreduce: the buffer each rank holds; allgather: the full gathered tensor (each rank holds B/n);
reduce_scatter: the full input each rank holds (each keeps B/n); all_to_all: each rank's send buffer;
p2p: the payload. Profiler fits use the per-rank input (comm_fit: the allgather *shard*); the
conversion happens here.

A group spanning nodes is priced on the inter-node link for all its steps (the ring's slowest hop
sets its pace). Not modelled: several groups sharing one node's NIC at the same time.
Measured fits describe the machine they were calibrated on: pass ``use_measured=False`` when pricing
a what-if fleet.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from services.planner.cost.profile_view import MeasuredFit
from services.planner.sim.model import LinkCost

if TYPE_CHECKING:
    from ballast.v1 import fleet_pb2

COLLECTIVES = ("p2p", "allreduce", "allgather", "reduce_scatter", "all_to_all")


class Scope(StrEnum):
    """Where a group's devices sit: all in one node, or across nodes."""

    INTRA = "intra_node"
    INTER = "inter_node"


def _steps(collective: str, n: int) -> int:
    """Latency-bound steps of the ring algorithm."""
    if collective == "p2p":
        return 1
    return 2 * (n - 1) if collective == "allreduce" else n - 1


def _bus_factor(collective: str, n: int) -> float:
    """Link bytes per *fit-input* byte (profiler comm_fit / nccl-tests convention)."""
    if collective == "p2p":
        return 1.0
    if collective == "allreduce":
        return 2.0 * (n - 1) / n
    if collective == "allgather":
        return float(n - 1)
    return (n - 1) / n


def _input_per_byte(collective: str, n: int) -> float:
    """Fit-input bytes per byte of this module's convention (the allgather fit takes the shard)."""
    return 1.0 / n if collective == "allgather" else 1.0


def _ring_volume(collective: str, n: int) -> float:
    """Bytes each rank sends over its link per byte of this module's convention."""
    if collective == "p2p":
        return 1.0
    if collective == "allreduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n


@dataclass(frozen=True)
class FleetView:
    """The parts of a Fleet the cost model reads. A link is None when the fleet does not give its
    bandwidth; pricing on it raises instead of pretending it is free."""

    devices_per_node: int
    nodes: int = 1
    intra_node: LinkCost | None = None
    inter_node: LinkCost | None = None
    host_link: LinkCost | None = None
    device_memory_bytes: int = 0
    device_kind: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.nodes < 1:
            raise ValueError(f"need at least one node of one device, got {self.nodes} x {self.devices_per_node}")

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    def link(self, scope: Scope) -> LinkCost:
        link = self.intra_node if scope is Scope.INTRA else self.inter_node
        if link is None:
            raise ValueError(f"fleet {self.name!r} has no {scope.value} link bandwidth; cannot price traffic on it")
        return link

    @classmethod
    def from_fleet(cls, fleet: fleet_pb2.Fleet) -> FleetView:
        def conv(link: fleet_pb2.Link) -> LinkCost | None:
            if link.bandwidth_bytes_per_s <= 0:
                return None
            return LinkCost(latency_s=max(0.0, link.latency_s), bandwidth_bytes_per_s=link.bandwidth_bytes_per_s)

        return cls(
            devices_per_node=max(1, fleet.devices_per_node),
            nodes=max(1, fleet.nodes),
            intra_node=conv(fleet.intra_node),
            inter_node=conv(fleet.inter_node),
            host_link=conv(fleet.device.host_link),
            device_memory_bytes=fleet.device.memory_bytes,
            device_kind=fleet.device.kind,
            name=fleet.name,
        )


def as_fleet_view(fleet: FleetView | fleet_pb2.Fleet) -> FleetView:
    return fleet if isinstance(fleet, FleetView) else FleetView.from_fleet(fleet)


@dataclass(frozen=True, slots=True)
class CommLine:
    """``seconds(nbytes) = latency_s + seconds_per_byte * nbytes`` and where it came from."""

    latency_s: float
    seconds_per_byte: float
    source: str

    def seconds(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency_s + self.seconds_per_byte * nbytes


_FREE = CommLine(0.0, 0.0, "no communication (group of one)")


class CommModel:
    """Collective and p2p prices for one fleet, optionally calibrated by a profile's fits."""

    def __init__(
        self, fleet: FleetView | fleet_pb2.Fleet, fits: Iterable[MeasuredFit] = (), *, use_measured: bool = True
    ) -> None:
        self.fleet = as_fleet_view(fleet)
        self.use_measured = use_measured
        self._fits: dict[tuple[str, str], dict[int, MeasuredFit]] = {}
        for f in fits:
            if f.collective not in COLLECTIVES:
                raise ValueError(f"unknown collective {f.collective!r} in fit")
            if f.bandwidth_bytes_per_s > 0 and f.group_size >= 2:
                self._fits.setdefault((f.collective, f.scope), {})[f.group_size] = f
        self._lines: dict[tuple[str, int, Scope], CommLine] = {}

    def line(self, collective: str, group_size: int, scope: Scope = Scope.INTRA) -> CommLine:
        """The cached price line (see the module docstring for sources and byte conventions)."""
        key = (collective, group_size, scope)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = self._make_line(collective, group_size, scope)
        return line

    def _make_line(self, collective: str, n: int, scope: Scope) -> CommLine:
        if collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}; expected one of {', '.join(COLLECTIVES)}")
        if collective == "p2p":
            n = 2
        elif n < 2:
            return _FREE
        per_input = _input_per_byte(collective, n)
        fits = self._fits.get((collective, scope.value), {}) if self.use_measured else {}
        if n in fits:
            f = fits[n]
            return CommLine(f.latency_s, per_input / f.bandwidth_bytes_per_s,
                            f"measured ({collective} n={n} fit, r2={f.r2:.3f})")
        if fits:
            k = min(fits, key=lambda g: (abs(math.log(n / g)), -g))
            f = fits[k]
            bus = _bus_factor(collective, k) * f.bandwidth_bytes_per_s
            return CommLine(
                f.latency_s * _steps(collective, n) / _steps(collective, k),
                per_input * _bus_factor(collective, n) / bus,
                f"measured, rescaled ({collective} n={k} fit moved to n={n} at equal bus bandwidth)",
            )
        link = self.fleet.link(scope)
        return CommLine(
            link.latency_s * _steps(collective, n),
            _ring_volume(collective, n) / link.bandwidth_bytes_per_s,
            f"from fleet links ({scope.value}: {link.bandwidth_bytes_per_s / 1e9:.3g} GB/s, "
            f"{link.latency_s * 1e6:.3g} us)",
        )

    def time(self, collective: str, nbytes: float, group_size: int, scope: Scope = Scope.INTRA) -> float:
        return self.line(collective, group_size, scope).seconds(nbytes)

    def source(self, collective: str, group_size: int, scope: Scope = Scope.INTRA) -> str:
        return self.line(collective, group_size, scope).source

    def p2p(self, nbytes: float, scope: Scope = Scope.INTRA) -> float:
        return self.line("p2p", 2, scope).seconds(nbytes)

    def allreduce(self, nbytes: float, group_size: int, scope: Scope = Scope.INTRA) -> float:
        return self.line("allreduce", group_size, scope).seconds(nbytes)

    def allgather(self, nbytes: float, group_size: int, scope: Scope = Scope.INTRA) -> float:
        return self.line("allgather", group_size, scope).seconds(nbytes)

    def reduce_scatter(self, nbytes: float, group_size: int, scope: Scope = Scope.INTRA) -> float:
        return self.line("reduce_scatter", group_size, scope).seconds(nbytes)

    def all_to_all(self, nbytes: float, group_size: int, scope: Scope = Scope.INTRA) -> float:
        return self.line("all_to_all", group_size, scope).seconds(nbytes)

    def p2p_link(self, scope: Scope) -> LinkCost:
        """The p2p line as the simulator's LinkCost (pipeline boundary links)."""
        line = self.line("p2p", 2, scope)
        bw = math.inf if line.seconds_per_byte <= 0 else 1.0 / line.seconds_per_byte
        return LinkCost(latency_s=line.latency_s, bandwidth_bytes_per_s=bw)
