"""The fleet policy a planner is started with (`--policy FILE`, BALLAST_FLEET_POLICY): stored as a new policy
version when it differs from the one in force, so every planner start makes the file the policy.

A policy stored later with `ballast policy set` stays in force until a planner starts again with a file that
differs from it. A file that cannot be read, or that the store refuses (unknown tenant, bad class), stops the
planner with the error naming the field.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ballast.v1 import fleet_pb2, store_pb2
from services.runtime.errors import FailedPrecondition, Unavailable
from services.runtime.store_api import Store
from services.specs.policy import load_policy_file

log = logging.getLogger("ballast.policy")
SERVER_SET = ("version", "created_at", "created_by")
ATTEMPTS = 3  # compare-and-set tries when another admin stores a policy at the same moment


def content(policy: fleet_pb2.FleetPolicy) -> fleet_pb2.FleetPolicy:
    """The policy without what the store sets (version, created_at, created_by), for comparing content."""
    out = fleet_pb2.FleetPolicy()
    out.CopyFrom(policy)
    for name in SERVER_SET:
        out.ClearField(name)
    return out


def apply_policy_file(store: Store, path: str | Path | None, wait_s: float = 30.0) -> fleet_pb2.FleetPolicy | None:
    """Load `path` and store it unless the policy in force already says the same; returns the version stored,
    or None when nothing changed (or no file is configured: `path` empty). Waits up to `wait_s` for a store
    that is still starting."""
    if not path:
        return None
    wanted = content(load_policy_file(path))  # InvalidArgument names the field
    for _ in range(ATTEMPTS):
        current = _current(store, wait_s)
        if content(current) == wanted:
            log.info("fleet policy file matches the policy in force",
                     extra={"path": str(path), "version": current.version})
            return None
        try:
            stored = store.set_fleet_policy(store_pb2.SetFleetPolicyRequest(policy=wanted,
                                                                            expected_version=current.version))
        except FailedPrecondition as exc:
            if exc.field != "expected_version":
                raise
            continue  # changed under us: compare with the new version
        log.info("stored the fleet policy file", extra={"path": str(path), "version": stored.version})
        return stored
    raise FailedPrecondition(f"the fleet policy kept changing while {path} was applied", field="policy",
                             fix="start the planner again once no one is storing policies")


def _current(store: Store, wait_s: float) -> fleet_pb2.FleetPolicy:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return store.get_fleet_policy(store_pb2.GetFleetPolicyRequest())
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
