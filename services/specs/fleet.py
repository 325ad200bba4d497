"""Fleet files: a homogeneous fleet in YAML, for what-if planning and for `ballast` commands.

Device and link figures come from the catalog (services/specs/catalog.py); the file only names
them, so one correction there fixes every fleet. Format (units are in the key names)::

    # 8x RTX TITAN 24 GB on one PCIe 3.0 host (Galvatron-BMW's testbed)
    name: 8x-titan              # optional; default "<nodes>x<devices_per_node>-<device kind>"
    device: titan-rtx-24gb      # required: catalog kind or alias (case, spaces, dashes ignored)
    nodes: 1                    # required: integer >= 1
    devices_per_node: 8         # required: integer >= 1
    intra_node: pcie3           # optional: link between devices of one node; default the device's usual one
    inter_node: ib-hdr-200      # link between nodes; required when nodes > 1, else optional
    memory_gib: 22              # optional: usable device memory in GiB (2**30 bytes); default the catalog's
    host_memory_gib: 256        # optional: host memory per node in GiB; default 0 = unknown
    dtype: fp16                 # optional: training precision (fp32, fp16, bf16) that sets peak FLOP/s;
                                #   default the device's fastest; load_fleet(dtype=...) overrides it
    tf32: false                 # optional: fp32 matmuls on TF32 tensor cores (default false, as in PyTorch)

A link is a catalog name (nvlink2/3/4, pcie3/4/5, ib-edr-100, ib-hdr-200, ib-ndr-400, eth-10/25/100,
shm) or an inline mapping, one-direction bandwidth in exactly one of two units:

    inter_node: {kind: ethernet, bandwidth_gbits_per_s: 40, latency_us: 30}   # network-style Gb/s
    intra_node: {kind: pcie, bandwidth_gbytes_per_s: 12, latency_us: 8}      # GB/s (10**9 bytes)

`kind` is nvlink, pcie, infiniband, ethernet or shared_memory. With one node and no inter_node the
proto's inter_node stays empty: there is no inter-node traffic to price. Every mistake raises
FleetFileError (an InvalidArgument and a ValueError) naming the field and the fix.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ballast.specfile import safe_yaml, yaml_problem
from ballast.v1 import fleet_pb2
from services.runtime.errors import InvalidArgument
from services.specs import catalog

KEYS = (
    "name",
    "device",
    "nodes",
    "devices_per_node",
    "intra_node",
    "inter_node",
    "memory_gib",
    "host_memory_gib",
    "dtype",
    "tf32",
)
REQUIRED = ("device", "nodes", "devices_per_node")
LINK_KEYS = ("kind", "bandwidth_gbytes_per_s", "bandwidth_gbits_per_s", "latency_us")
LINK_KINDS = {name.removeprefix("LINK_KIND_").lower(): value for name, value in fleet_pb2.LinkKind.items() if value}


_LINK_FIX = f"a catalog link ({', '.join(catalog.LINKS)}) or an inline mapping (see services/specs/fleet.py)"


class FleetFileError(InvalidArgument, ValueError):
    """A fleet file that cannot be loaded; `field` is the offending key (dotted inside a link)."""


def load_fleet(source: str | os.PathLike[str], *, dtype: str | int | None = None) -> fleet_pb2.Fleet:
    """Fleet from a YAML file path, or from YAML text (a str holding a newline or a ':').

    `dtype` (a precision name or common_pb2.DType) overrides the file's dtype.
    """
    where = "the fleet"
    if isinstance(source, str) and ("\n" in source or ":" in source):
        text = source
    else:
        where = os.fspath(source)
        try:
            text = Path(source).read_text()
        except OSError as err:
            raise FleetFileError(
                f"cannot read {os.fspath(source)!r}: {err.strerror}",
                field="fleet file",
                fix="pass an existing YAML file, e.g. examples/fleet-8xTITAN.yaml",
            ) from None
    try:
        data = safe_yaml(text)
    except yaml.YAMLError as err:
        raise FleetFileError(f"{where} is not valid YAML: {yaml_problem(err)}", field="fleet file",
                             fix="fix the YAML syntax") from None
    return fleet_from_dict(data, dtype=dtype)


def fleet_from_dict(d: Mapping[str, Any], *, dtype: str | int | None = None) -> fleet_pb2.Fleet:
    """Fleet from the parsed file (a mapping with the keys in the module docstring)."""
    if not isinstance(d, Mapping):
        raise FleetFileError(
            f"expected a mapping of keys, got {type(d).__name__}",
            field="fleet file",
            fix=f"write `key: value` lines; required: {', '.join(REQUIRED)}",
        )
    _check_keys(d, KEYS, REQUIRED, prefix="")
    entry = _catalog(
        catalog.device, _text(d, "device"), "device", f"a catalog kind or alias: {', '.join(catalog.DEVICES)}"
    )
    nodes, per_node = _count(d, "nodes"), _count(d, "devices_per_node")
    has_inter = d.get("inter_node") is not None
    if nodes > 1 and not has_inter:
        raise FleetFileError(f"required when nodes > 1 (nodes: {nodes})", field="inter_node", fix=_LINK_FIX)
    tf32 = d.get("tf32", False)
    if not isinstance(tf32, bool):
        raise FleetFileError(f"must be true or false, got {tf32!r}", field="tf32", fix="write tf32: true or false")
    try:
        spec = catalog.to_proto(entry, dtype if dtype is not None else d.get("dtype"), tf32=tf32)
    except InvalidArgument as err:
        raise _refield(err, "dtype") from None
    if "memory_gib" in d:
        spec.memory_bytes = round(_gib(d, "memory_gib") * catalog.GiB)
    intra = d.get("intra_node")
    fleet = fleet_pb2.Fleet(
        name=_text(d, "name") if "name" in d else f"{nodes}x{per_node}-{entry.kind}",
        device=spec,
        devices_per_node=per_node,
        nodes=nodes,
        intra_node=_link(intra, "intra_node") if intra is not None else catalog.link(entry.intra_node_link).to_proto(),
        host_memory_bytes_per_node=round(_gib(d, "host_memory_gib") * catalog.GiB) if "host_memory_gib" in d else 0,
    )
    if has_inter:
        fleet.inter_node.CopyFrom(_link(d["inter_node"], "inter_node"))
    return fleet


def _check_keys(d: Mapping[str, Any], known: tuple[str, ...], required: tuple[str, ...], *, prefix: str) -> None:
    for key in d:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise FleetFileError(f"unknown key {key!r}", field=f"{prefix}{key}", fix=f"{hint}known: {', '.join(known)}")
    for key in required:
        if key not in d:
            raise FleetFileError("missing required key", field=f"{prefix}{key}", fix=f"add `{key}:`")


def _text(d: Mapping[str, Any], key: str) -> str:
    value = d[key]
    if not isinstance(value, str) or not value.strip():
        raise FleetFileError(f"must be a non-empty string, got {value!r}", field=key, fix=f"write {key}: <name>")
    return value.strip()


def _count(d: Mapping[str, Any], key: str) -> int:
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FleetFileError(f"must be a positive integer, got {value!r}", field=key, fix=f"write {key}: 1 or more")
    return value


def _number(value: Any, field: str, *, unit: str, allow_zero: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        rule = "a non-negative" if allow_zero else "a positive"
        raise FleetFileError(
            f"must be {rule} number of {unit}, got {value!r}",
            field=field,
            fix=f"write {field.rsplit('.', 1)[-1]}: <{unit}>",
        )
    return float(value)


def _gib(d: Mapping[str, Any], key: str) -> float:
    return _number(d[key], key, unit="GiB")


def _link(value: Any, field: str) -> fleet_pb2.Link:
    if isinstance(value, str):
        return _catalog(catalog.link, value, field, _LINK_FIX)
    if not isinstance(value, Mapping):
        raise FleetFileError(
            f"expected a link name or mapping, got {value!r}",
            field=field,
            fix="e.g. pcie4, or {kind: pcie, bandwidth_gbytes_per_s: 12, latency_us: 8}",
        )
    _check_keys(value, LINK_KEYS, ("kind", "latency_us"), prefix=f"{field}.")
    units = [k for k in ("bandwidth_gbytes_per_s", "bandwidth_gbits_per_s") if k in value]
    if len(units) != 1:
        raise FleetFileError(
            f"give exactly one bandwidth, got {len(units)}",
            field=f"{field}.bandwidth_gbytes_per_s",
            fix="bandwidth_gbytes_per_s (GB/s) or bandwidth_gbits_per_s (Gb/s), one direction",
        )
    kind = LINK_KINDS.get(str(value["kind"]).lower().removeprefix("link_kind_"))
    if kind is None:
        raise FleetFileError(
            f"unknown link kind {value['kind']!r}", field=f"{field}.kind", fix=f"one of {', '.join(LINK_KINDS)}"
        )
    unit = units[0]
    bandwidth = _number(value[unit], f"{field}.{unit}", unit="GB/s" if "gbytes" in unit else "Gb/s")
    latency = _number(value["latency_us"], f"{field}.latency_us", unit="us", allow_zero=True)
    return fleet_pb2.Link(
        kind=kind,
        bandwidth_bytes_per_s=bandwidth * (1e9 if "gbytes" in unit else 1e9 / 8),
        latency_s=latency * 1e-6,
    )


def _catalog(lookup: Any, name: str, field: str, fix: str) -> Any:
    try:
        entry = lookup(name)
    except InvalidArgument:
        raise FleetFileError(f"unknown {field.replace('_', ' ')} {name!r}", field=field, fix=fix) from None
    return entry.to_proto() if isinstance(entry, catalog.LinkEntry) else entry


def _refield(err: InvalidArgument, field: str) -> FleetFileError:
    """The catalog's error, re-raised as a FleetFileError under the file's field name."""
    text = str(err)
    if err.field:
        text = text.removeprefix(f"{err.field}: ")
    if err.fix:
        text = text.removesuffix(f" ({err.fix})")
    return FleetFileError(text, field=field, fix=err.fix)
