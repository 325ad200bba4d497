"""How a count of devices that is not the whole fleet is priced: the uniform fleet a plan for it is searched on."""

from __future__ import annotations

import math


def cut_shape(devices: int, devices_per_node: int) -> tuple[int, int]:
    """(nodes, devices per node) of the uniform fleet that prices `devices` of a fleet with `devices_per_node`
    per node: one node when they fit in one; else groups of g = gcd(devices, devices_per_node), every one of
    which sits inside a node of any placement of whole nodes plus a remainder (12 of 8-device nodes: 3 x 4,
    the 8 + 4 the devices come as), so the plan's links are never faster than the placement's."""
    if devices < 1 or devices_per_node < 1:
        raise ValueError(f"need devices >= 1 and devices_per_node >= 1, got {devices}, {devices_per_node}")
    if devices <= devices_per_node:
        return 1, devices
    group = math.gcd(devices, devices_per_node)
    return devices // group, group
