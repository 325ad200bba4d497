"""A model's weights under its own parameter names: read from a checkpoint's per-layer files (any strategy wrote
them unsharded, in the model's own row order), written as an export (`ballast export`), loaded into a stage to
start a job from them (JobSpec.init_from).

Own names are the names a user knows: the zoo model's (`blocks.0.attn.qkv.weight`), a user's module's
(`block0.up.weight`, without Ballast's `inner.` wrapper) and a Hugging Face model's (`model.layers.0.mlp.up_proj.
weight`, what `save_pretrained` writes). A tied weight has one name, its first. Exports are safetensors (or a
torch state dict, or a Hugging Face `save_pretrained` directory): a pickle is never read back.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ballast.v1 import model_pb2
from services.executor.train import checkpoint as ckpt
from services.runtime.errors import FailedPrecondition, InvalidArgument
from services.specs.user_inputs import UserInputs
from services.zoo import ZooModel, build_model
from services.zoo.graph import Decomposition

WEIGHTS = "model.safetensors"
TORCH_WEIGHTS = "model.pt"
META = "ballast.json"
FORMATS = ("safetensors", "torch", "hf")
WRAPPERS = {model_pb2.MODEL_FAMILY_CUSTOM: "inner.", model_pb2.MODEL_FAMILY_HF: "hf."}


def digest(named: list[tuple[str, Tensor]]) -> str:
    """One hash of named tensors, in the order given (a layer's parameters, as `named_parameters` lists them)."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def own_name(spec: model_pb2.ModelSpec, name: str) -> str:
    """The name without Ballast's wrapper of a user's or a Hugging Face model."""
    return name.removeprefix(WRAPPERS.get(spec.family, ""))


def layer_names(model: nn.Module, dec: Decomposition, spec: model_pb2.ModelSpec) -> dict[tuple[int, str], str]:
    """(layer index, the parameter's name within the layer) -> its own name in the model."""
    qualified = {id(p): own_name(spec, n) for n, p in model.named_parameters()}
    return {(layer.index, local): qualified[id(p)] for layer in dec.layers
            for local, p in layer.module.named_parameters()}


def checkpoint_weights(directory: str | Path, spec: model_pb2.ModelSpec,
                       user_inputs: UserInputs) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Every parameter of a complete checkpoint under its own name, each file's hash checked; and its manifest."""
    folder = ckpt.local_path(directory)
    try:
        manifest = ckpt.read_manifest(folder)
    except RuntimeError as exc:
        raise FailedPrecondition(str(exc), field="iteration", fix="export another of the job's checkpoints") from None
    model = build_model(spec, device="meta", user_inputs=user_inputs)
    dec = model.decompose()
    if manifest.get("num_layers") != len(dec):
        raise FailedPrecondition(f"the checkpoint has {manifest.get('num_layers')} layers, the model {len(dec)}",
                                 field="iteration", fix="export a checkpoint of this job's model")
    names = layer_names(model, dec, spec)
    weights: dict[str, Tensor] = {}
    for index, entry in sorted(manifest["layers"].items(), key=lambda kv: int(kv[0])):
        data = (folder / entry["file"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise FailedPrecondition(f"checkpoint {folder}: {entry['file']} does not match its sha256",
                                     field="iteration", fix="export an earlier checkpoint")
        tensors = torch.load(folder / entry["file"], map_location="cpu", weights_only=True)
        for key, value in tensors.items():
            if key.startswith("param/"):
                weights[names[(int(index), key.removeprefix("param/"))]] = value
    return weights, manifest


def export(directory: str | Path, spec: model_pb2.ModelSpec, fmt: str, out: Path, user_inputs: UserInputs,
           meta: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """Write a checkpoint's weights into `out` as `fmt`; the files written (name, bytes, sha256) and the
    checkpoint's iteration."""
    if fmt not in FORMATS:
        raise InvalidArgument(f"unknown format {fmt!r}", field="format", fix=f"one of {', '.join(FORMATS)}")
    if fmt == "hf" and spec.family != model_pb2.MODEL_FAMILY_HF:
        raise InvalidArgument("the hf format is a Hugging Face model's save_pretrained directory", field="format",
                              fix="export this model as safetensors or torch")
    weights, manifest = checkpoint_weights(directory, spec, user_inputs)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / WEIGHTS), metadata={"format": "pt"})
    elif fmt == "torch":
        torch.save(weights, out / TORCH_WEIGHTS)  # a plain {name: tensor}: loads with weights_only=True
    else:
        model = build_model(spec, seed=0, user_inputs=user_inputs)
        assign(model, spec, weights)
        model.hf.save_pretrained(out, safe_serialization=True)
    (out / META).write_text(json.dumps({**meta, "iteration": manifest["iterations_done"], "format": fmt,
                                        "parameters": sum(v.numel() for v in weights.values())}, indent=1))
    files = [{"name": p.name, "bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(out.iterdir()) if p.is_file()]
    return files, int(manifest["iterations_done"])


def assign(model: ZooModel, spec: model_pb2.ModelSpec, weights: dict[str, Tensor]) -> None:
    """Copy `weights` (own names) into a built model; every parameter must be given, and fit."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            own = own_name(spec, name)
            if own not in weights:
                raise InvalidArgument(f"the weights have no {own!r}", field="init_from",
                                      fix="start from weights exported from this model")
            if tuple(weights[own].shape) != tuple(p.shape):
                raise InvalidArgument(f"{own} is {tuple(weights[own].shape)} in the weights, {tuple(p.shape)} in the "
                                      "model", field="init_from", fix="start from weights exported from this model")
            p.copy_(weights[own])


def initial_weights(path: str, spec: model_pb2.ModelSpec, user_inputs: UserInputs) -> dict[str, Tensor]:
    """The weights a job starts from: a checkpoint directory (manifest.json) or an export (model.safetensors)."""
    folder = ckpt.local_path(path)
    if (folder / ckpt.MANIFEST).exists():
        return checkpoint_weights(folder, spec, user_inputs)[0]
    if (folder / WEIGHTS).exists():
        return load_file(str(folder / WEIGHTS))
    raise InvalidArgument(f"{path} holds neither a checkpoint nor exported weights ({WEIGHTS})", field="init_from",
                          fix="give a directory `ballast export --format safetensors` wrote, or a job")


def load_into(layers: list, names: dict[tuple[int, str], str], weights: dict[str, Tensor]) -> None:
    """Copy the held layers' parameters from `weights` (own names), before any is split or sharded."""
    with torch.no_grad():
        for layer in layers:
            for local, p in layer.module.named_parameters():
                own = names[(layer.index, local)]
                if own not in weights:
                    raise InvalidArgument(f"the weights have no {own!r}", field="init_from",
                                          fix="start from weights exported from this model")
                p.copy_(weights[own].to(p.device))
