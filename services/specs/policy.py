"""Fleet policy: priority classes, per-tenant quotas and fair-share weights, preemption limits.

The store keeps every version (SetFleetPolicy); the planner reads the one in force. A policy file is the
same message in YAML, loaded by `ballast up --policy FILE` or `ballast serve planner --policy FILE` (or at run
time `ballast policy set FILE`)::

    default_priority_class: normal
    priority_classes:                 # larger priority is admitted first; `preempts` may evict lower ones
      - {name: low, priority: 0}
      - {name: normal, priority: 10}
      - {name: high, priority: 100, preempts: true}
    tenants:                          # a tenant not listed: weight 1, no quota, the default class at most
      - {tenant: research, device_quota: 4, weight: 1, max_priority_class: normal}
      - {tenant: prod, weight: 3, max_priority_class: high}
    fair_share_half_life_s: 3600      # how fast past use is forgotten
    max_preemptions_per_hour: 2       # per job

Every mistake raises InvalidArgument naming the field and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import yaml
from google.protobuf.json_format import ParseDict, ParseError

from ballast.specfile import safe_yaml, yaml_problem
from ballast.v1 import fleet_pb2
from services.runtime.errors import FailedPrecondition, InvalidArgument

DEFAULT_HALF_LIFE_S = 3600.0
DEFAULT_MAX_PREEMPTIONS = 2


def default_policy() -> fleet_pb2.FleetPolicy:
    """What a fleet runs under until an admin stores a policy: three classes, only `high` preempts."""
    return fleet_pb2.FleetPolicy(
        version=0,
        priority_classes=[
            fleet_pb2.PriorityClass(name="low", priority=0),
            fleet_pb2.PriorityClass(name="normal", priority=10),
            fleet_pb2.PriorityClass(name="high", priority=100, preempts=True),
        ],
        default_priority_class="normal",
    )


def check_policy(policy: fleet_pb2.FleetPolicy, tenant_names: Iterable[str], prefix: str = "policy") -> None:
    """Raise InvalidArgument naming the first bad field; tenants must exist."""
    names = [c.name for c in policy.priority_classes]
    if not names:
        raise InvalidArgument("a policy needs at least one priority class", field=f"{prefix}.priority_classes",
                              fix="e.g. {name: normal, priority: 10}")
    for i, c in enumerate(policy.priority_classes):
        if not c.name or len(c.name) > 63:
            raise InvalidArgument("a priority class needs a name of 1-63 characters",
                                  field=f"{prefix}.priority_classes[{i}].name", fix='e.g. "high"')
        if names.count(c.name) > 1:
            raise InvalidArgument(f"priority class {c.name!r} is defined twice",
                                  field=f"{prefix}.priority_classes[{i}].name", fix="keep one entry per class")
    if policy.default_priority_class not in names:
        raise InvalidArgument(f"default class {policy.default_priority_class!r} is not one of {names}",
                              field=f"{prefix}.default_priority_class", fix=f"use one of {', '.join(names)}")
    known = set(tenant_names)
    seen: set[str] = set()
    for i, t in enumerate(policy.tenants):
        where = f"{prefix}.tenants[{i}]"
        if t.tenant not in known:
            raise InvalidArgument(f"unknown tenant {t.tenant!r}", field=f"{where}.tenant",
                                  fix="create the tenant first (ballast tenant create NAME), or remove the entry")
        if t.tenant in seen:
            raise InvalidArgument(f"tenant {t.tenant!r} is listed twice", field=f"{where}.tenant",
                                  fix="keep one entry per tenant")
        seen.add(t.tenant)
        if t.weight < 0 or not math.isfinite(t.weight):
            raise InvalidArgument(f"weight {t.weight} is not a finite number >= 0", field=f"{where}.weight",
                                  fix="e.g. 1 (0 means 1)")
        if t.max_priority_class and t.max_priority_class not in names:
            raise InvalidArgument(f"unknown priority class {t.max_priority_class!r}",
                                  field=f"{where}.max_priority_class", fix=f"use one of {', '.join(names)}")
    if policy.fair_share_half_life_s < 0 or not math.isfinite(policy.fair_share_half_life_s):
        raise InvalidArgument("must be a finite number of seconds >= 0", field=f"{prefix}.fair_share_half_life_s",
                              fix="e.g. 3600 (0 means 3600)")


def priority_class(policy: fleet_pb2.FleetPolicy, name: str) -> fleet_pb2.PriorityClass:
    """The class called `name` ("" = the default); InvalidArgument for an unknown one."""
    wanted = name or policy.default_priority_class
    for c in policy.priority_classes:
        if c.name == wanted:
            return c
    raise InvalidArgument(f"unknown priority class {wanted!r}", field="spec.priority_class",
                          fix="use one of " + ", ".join(c.name for c in policy.priority_classes))


def tenant_policy(policy: fleet_pb2.FleetPolicy, tenant_name: str) -> fleet_pb2.TenantPolicy:
    """The tenant's entry with defaults filled in (weight 1, no quota, the default class at most)."""
    for t in policy.tenants:
        if t.tenant == tenant_name:
            out = fleet_pb2.TenantPolicy()
            out.CopyFrom(t)
            break
    else:
        out = fleet_pb2.TenantPolicy(tenant=tenant_name)
    out.weight = out.weight or 1.0
    out.max_priority_class = out.max_priority_class or policy.default_priority_class
    return out


def class_for(policy: fleet_pb2.FleetPolicy, tenant_name: str, name: str) -> fleet_pb2.PriorityClass:
    """The class a tenant's job asked for, refused (FailedPrecondition) above the tenant's maximum."""
    wanted = priority_class(policy, name)
    ceiling = priority_class(policy, tenant_policy(policy, tenant_name).max_priority_class)
    if wanted.priority > ceiling.priority:
        raise FailedPrecondition(
            f"priority class {wanted.name!r} is above tenant {tenant_name!r}'s maximum {ceiling.name!r}",
            field="spec.priority_class", fix=f"submit with --priority {ceiling.name} or lower, or ask the platform "
            "admin to raise the tenant's max_priority_class")
    return wanted


def half_life_s(policy: fleet_pb2.FleetPolicy) -> float:
    return policy.fair_share_half_life_s or DEFAULT_HALF_LIFE_S


def max_preemptions(policy: fleet_pb2.FleetPolicy) -> int:
    return policy.max_preemptions_per_hour or DEFAULT_MAX_PREEMPTIONS


def load_policy_file(path: str | Path) -> fleet_pb2.FleetPolicy:
    """A policy from YAML (see the module docstring); InvalidArgument names what is wrong."""
    try:
        raw = safe_yaml(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        why = yaml_problem(exc) if isinstance(exc, yaml.YAMLError) else exc
        raise InvalidArgument(f"cannot read policy file {path}: {why}", field="policy",
                              fix="pass a readable YAML file") from None
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{path} is not a YAML mapping", field="policy", fix="see `ballast policy --help`")
    try:
        return ParseDict(raw, fleet_pb2.FleetPolicy())
    except ParseError as exc:
        raise InvalidArgument(f"{path}: {exc}", field="policy", fix="see services/specs/policy.py") from None
