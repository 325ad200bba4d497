"""Per-layer checkpoints (Varuna §4.5): one file per layer, so a job resumes under another stage count.

A layer file is a flat {str: Tensor} dict: "param/<name>" and "state/<key>/<name>" (the optimizer state,
e.g. Adam's exp_avg, exp_avg_sq, step), keyed by the parameter's name within the layer. A tied Parameter is
saved once, under the lowest layer holding it, and loaded into every layer holding it. Files load with
`torch.load(weights_only=True)`: nothing is unpickled beyond tensors. Files are unsharded whatever the layer's
data-parallel flavour: a ZeRO layer's state is gathered before it is written (sharding.py) and sliced again
when loaded under ZeRO, so any flavour, replica count or stage layout resumes from any checkpoint.

Layout: `<checkpoint_dir>/iter-<done:08d>/layer-<i:05d>.pt`, a `layer-<i:05d>.json` sidecar (sha256, bytes),
and `manifest.json`, written last (after every layer is on disk) with "complete": true. A directory without
its manifest is never resumed from. Every write goes to a temporary name in the same directory, is fsynced,
then renamed over the final name. The directory must be shared by the ranks (one host, or a network FS).
No RNG state is saved: samples and dropout seeds derive from (seed, iteration, micro-batch).

Written in the background (Varuna §4.5 overlaps them with compute): `snapshot` copies a rank's layers to host
memory at the boundary, `write_snapshot` writes them while the next iterations run, and rank 0 writes the
manifest once every layer's sidecar is on disk (`await_layers`: the shared directory is the barrier, so the
writer threads never enter a collective beside the training loop's).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch
from torch import Tensor

from services.zoo.graph import Layer

MANIFEST = "manifest.json"
FORMAT = 1
FAILED = "failed-rank-"  # an empty file a rank leaves when its part of a checkpoint could not be written
# The host's storage refusing a write: no space, over quota, an I/O error. A checkpoint that meets one fails alone.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})
Aliases = dict[tuple[int, str], tuple[int, str]]
Snapshot = dict[int, tuple[str, dict[str, Tensor]]]  # layer index -> (layer name, its flat tensors)
# An optimizer, or per-parameter state keyed by the Parameter (what sharding.Sharded.state gathers).
StateSource = torch.optim.Optimizer | Mapping[Any, dict[str, Any]]
POLL_S = 0.02


def local_path(location: str | Path) -> Path:
    """A checkpoint directory from a path, a file:// URI, or either naming the manifest itself."""
    text = str(location)
    path = Path(unquote(urlparse(text).path)) if text.startswith("file://") else Path(text)
    return path.parent if path.name == MANIFEST else path


def checkpoint_path(root: str | Path, iterations_done: int) -> Path:
    return Path(root) / f"iter-{iterations_done:08d}"


def layer_file(index: int) -> str:
    return f"layer-{index:05d}.pt"


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def layer_tensors(layer: Layer, aliases: Aliases, optimizer: StateSource, copy: bool = False) -> dict[str, Tensor]:
    """`copy`: host copies that the next optimizer steps cannot change (on the CPU `.cpu()` is the same storage)."""
    state = optimizer.state if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    out: dict[str, Tensor] = {}
    for name, p in layer.module.named_parameters():
        if (layer.index, name) in aliases:
            continue  # saved by the owning (lowest) layer
        out[f"param/{name}"] = p.detach().to("cpu", copy=copy)
        for key, value in state.get(p, {}).items():
            if isinstance(value, Tensor):
                out[f"state/{key}/{name}"] = value.detach().to("cpu", copy=copy)
    return out


def snapshot(layers: list[Layer], aliases: Aliases, optimizer: StateSource) -> Snapshot:
    """Copies of these layers' parameters and optimizer state, to write while training goes on."""
    return {layer.index: (layer.name, layer_tensors(layer, aliases, optimizer, copy=True)) for layer in layers}


def write_snapshot(directory: Path, layers: Snapshot) -> list[dict[str, Any]]:
    """Write one file (plus a sidecar naming its hash) per layer; returns the entries for the report."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for index, (name, tensors) in layers.items():
        buffer = io.BytesIO()
        torch.save(tensors, buffer)
        data = buffer.getvalue()
        path = directory / layer_file(index)
        atomic_write(path, data)
        entry = {"layer_index": index, "name": name, "file": path.name, "uri": path.resolve().as_uri(),
                 "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        atomic_write(path.with_suffix(".json"), json.dumps(entry).encode())
        entries.append(entry)
    return entries


def write_layers(
    directory: Path, layers: list[Layer], aliases: Aliases, optimizer: torch.optim.Optimizer
) -> list[dict[str, Any]]:
    """Write these layers now (no copy: nothing steps the optimizer meanwhile)."""
    return write_snapshot(directory, {x.index: (x.name, layer_tensors(x, aliases, optimizer)) for x in layers})


def remove_manifest(directory: Path) -> None:
    """Before rewriting a directory: a stale manifest must never vouch for half-replaced layer files."""
    (directory / MANIFEST).unlink(missing_ok=True)


def clear_stale(directory: Path) -> None:
    """The manifest and every sidecar of an earlier write here, so `await_layers` counts only this write's."""
    remove_manifest(directory)
    for sidecar in [*directory.glob("layer-*.json"), *directory.glob(f"{FAILED}*")]:
        sidecar.unlink(missing_ok=True)


class CheckpointFailed(Exception):
    """A rank could not write its part of this checkpoint (the disk is full): it stays incomplete, training goes on."""


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def fail(directory: Path, rank: int, layers: Iterable[int]) -> None:
    """After a disk error: remove this rank's files of the checkpoint (the space they took, temporary ones too) and
    leave an empty marker, so the ranks waiting for them stop waiting. Best effort: the marker needs no data block."""
    names = [n for i in layers for n in (layer_file(i), layer_file(i).replace(".pt", ".json"))]
    for path in [directory / n for n in names] + list(directory.glob(f".*.tmp-{os.getpid()}")):
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
    try:
        (directory / f"{FAILED}{rank}").touch()
    except OSError:
        pass


def failed(directory: Path) -> bool:
    return any(directory.glob(f"{FAILED}*"))


def await_manifest(directory: Path, cancelled: Callable[[], bool], timeout_s: float) -> bool:
    """Wait until rank 0 wrote this checkpoint's manifest; False when cancelled; TimeoutError after `timeout_s`;
    CheckpointFailed when a rank could not write its part."""
    deadline = time.monotonic() + timeout_s
    while not (directory / MANIFEST).exists():
        if cancelled():
            return False
        if failed(directory):
            raise CheckpointFailed(f"checkpoint {directory}: a rank could not write its part")
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint {directory}: no manifest within {timeout_s:g} s (rank 0 stopped "
                               "writing it); the checkpoint stays incomplete")
        time.sleep(POLL_S)
    return True


def await_layers(directory: Path, num_layers: int, cancelled: Callable[[], bool], timeout_s: float) -> bool:
    """Wait until every layer's sidecar is on disk (written by whichever rank owns it); False when cancelled.

    Raises TimeoutError after `timeout_s` (a peer that never wrote its layers: lost, so infrastructure)."""
    deadline = time.monotonic() + timeout_s
    names = [directory / layer_file(i).replace(".pt", ".json") for i in range(num_layers)]
    while not all(n.exists() for n in names):
        if cancelled():
            return False
        if failed(directory):
            raise CheckpointFailed(f"checkpoint {directory}: a rank could not write its part")
        if time.monotonic() > deadline:
            missing = [i for i, n in enumerate(names) if not n.exists()]
            raise TimeoutError(f"checkpoint {directory}: layers {missing[:8]} were not written within {timeout_s:g} s "
                               "(a peer stopped writing); the checkpoint stays incomplete")
        time.sleep(POLL_S)
    return True


def write_manifest(directory: Path, num_layers: int, meta: dict[str, Any]) -> Path:
    """Gather every layer's sidecar and write the manifest last; raises if a layer is missing."""
    layers = {}
    for i in range(num_layers):
        sidecar = directory / layer_file(i).replace(".pt", ".json")
        if not sidecar.exists():
            raise RuntimeError(f"checkpoint {directory}: layer {i} was not written; the checkpoint is incomplete")
        layers[str(i)] = json.loads(sidecar.read_text())
    manifest = {"format": FORMAT, "complete": True, "num_layers": num_layers, "layers": layers, **meta}
    path = directory / MANIFEST
    atomic_write(path, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return path


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = local_path(directory) / MANIFEST
    if not path.exists():
        raise RuntimeError(f"resume_from {directory}: no {MANIFEST}, so this checkpoint is incomplete (a writer "
                           "stopped before finishing) and is never resumed from; resume from an earlier complete one")
    manifest = json.loads(path.read_text())
    if manifest.get("complete") is not True or manifest.get("format") != FORMAT:
        raise RuntimeError(f"resume_from {directory}: {MANIFEST} is not a complete format-{FORMAT} checkpoint")
    return manifest


def check_compatible(manifest: dict[str, Any], model: dict[str, Any], optimizer_name: str, num_layers: int) -> None:
    if manifest.get("model") != model:
        raise ValueError("resume_from: the checkpoint was written for a different model spec; resume with the same "
                         "WorkerConfig.model")
    if manifest.get("optimizer") != optimizer_name:
        raise ValueError(f"resume_from: the checkpoint holds {manifest.get('optimizer')!r} optimizer state; set "
                         f"WorkerConfig.optimizer.name to it")
    if manifest.get("num_layers") != num_layers:
        raise ValueError(f"resume_from: checkpoint has {manifest.get('num_layers')} layers, the model {num_layers}")


def check_position(manifest: dict[str, Any], data: dict[str, Any], global_batch_size: int, seed: int) -> None:
    """The position in the data is the checkpoint's samples_seen = next_iteration x global_batch_size in the order the
    seed and the data fix: a resume goes on only with the same three (a morph keeps them all). Checkpoints written
    before 2026-11-29 name the global batch `global_batch`."""
    if "global_batch" in manifest and "global_batch_size" not in manifest:
        manifest = {**manifest, "global_batch_size": manifest["global_batch"]}
    for name, ours in (("data", data), ("global_batch_size", global_batch_size), ("seed", seed)):
        if name in manifest and manifest[name] != ours:
            raise ValueError(f"resume_from: the checkpoint was written with {name} {manifest[name]!r}, this run has "
                             f"{ours!r}; resume with the checkpoint's {name} (its position in the data depends on it)")


def load_layers(
    directory: str | Path,
    manifest: dict[str, Any],
    layers: list[Layer],
    aliases: Aliases,
    optimizer: torch.optim.Optimizer,
    state_on_host: bool = False,
) -> None:
    """Copy parameters and optimizer state of `layers` (any partition) from the checkpoint, checking hashes.

    `state_on_host` leaves the optimizer state in host memory (ZeRO layers slice their chunk from it and move
    only that to the device, so a resume never holds a sharded layer's full state on the device)."""
    directory = local_path(directory)
    files: dict[int, dict[str, Tensor]] = {}

    def tensors(i: int) -> dict[str, Tensor]:
        if i not in files:
            entry = manifest["layers"][str(i)]
            path = directory / entry["file"]
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise RuntimeError(f"resume_from {directory}: {path.name} does not match its sha256 in {MANIFEST}")
            files[i] = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        return files[i]

    for layer in layers:
        for name, p in layer.module.named_parameters():
            source, source_name = aliases.get((layer.index, name), (layer.index, name))
            data = tensors(source)
            key = f"param/{source_name}"
            if key not in data:
                raise RuntimeError(f"resume_from {directory}: layer {source} has no parameter {source_name!r}")
            with torch.no_grad():
                p.copy_(data[key])
            state = {k.split("/", 2)[1]: v for k, v in data.items() if k.startswith("state/")
                     and k.split("/", 2)[2] == source_name}
            if state:
                optimizer.state[p] = {k: v.clone() if state_on_host else _place(v, p) for k, v in state.items()}


def _place(value: Tensor, p: Tensor) -> Tensor:
    """Adam keeps its scalar `step` on the CPU (non-capturable); everything else lives with the parameter."""
    return value.clone() if value.dim() == 0 else value.to(p.device, copy=True)

