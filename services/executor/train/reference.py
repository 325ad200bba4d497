"""Single-process reference run: the whole model, one process, the same data, seed and optimizer.

Harmony §5.4's correctness test: a pipelined, data-parallel run must reproduce these per-iteration losses.
The loss of an iteration is the summed loss of the global batch divided by its label count, computed by the
model's own `forward` (not the layer-by-layer path), so the reference also checks the decomposition. With
`layer_toggles` (dynamic workloads) the decomposed layers run in order instead, an inactive layer returning its
first input, as the workers do.
"""

from __future__ import annotations

from typing import Any

import torch
from google.protobuf.json_format import MessageToDict

from ballast.v1 import model_pb2
from services.data.batches import Data, batch_for, validation_batch_for
from services.executor.train import checkpoint as ckpt
from services.executor.train.data import dropout_seed
from services.executor.train.stage import layer_active, make_optimizer, model_info, parse_toggles, tied_aliases
from services.specs.user_inputs import NO_USER_INPUTS, UserInputs
from services.zoo import build_model


def train_single(
    spec: model_pb2.ModelSpec,
    data: Data,
    seed: int,
    global_batch_size: int,
    iterations: int,
    optimizer: dict[str, Any],
    *,
    start_iteration: int = 0,
    resume_from: str = "",
    checkpoint_dir: str = "",
    checkpoint_every: int = 0,
    device: str = "cpu",
    layer_toggles: list[list[int]] | None = None,
    user_inputs: UserInputs = NO_USER_INPUTS,
) -> list[float]:
    """Mean losses of iterations start..iterations-1 (resumed iterations start at the checkpoint's)."""
    model = build_model(spec, seed=seed, device=device, user_inputs=user_inputs)
    model.train()
    dec = model.decompose()
    aliases = tied_aliases(model, dec, 0, len(dec))
    toggles = parse_toggles(model_info(spec, 1, user_inputs), layer_toggles) if layer_toggles else None
    opt = make_optimizer(list(model.parameters()), optimizer)
    model_dict = MessageToDict(spec, preserving_proto_field_name=True)
    if resume_from:
        manifest = ckpt.read_manifest(resume_from)
        ckpt.check_compatible(manifest, model_dict, optimizer["name"], len(dec))
        ckpt.load_layers(resume_from, manifest, dec.layers, aliases, opt)
        start_iteration = manifest["next_iteration"]
    losses = []
    for iteration in range(start_iteration, iterations):
        batch = {k: v.to(device) for k, v in
                 batch_for(spec, data, seed, iteration, 0, global_batch_size, global_batch_size=global_batch_size,
                           user_inputs=user_inputs).items()}
        count = max(model.loss_count(batch), 1)
        torch.manual_seed(dropout_seed(seed, iteration, 0))
        if toggles is None:
            loss = model(batch)
        else:
            env: dict[int, torch.Tensor] = {}
            for layer in dec.layers:
                if not layer_active(toggles, layer.index, iteration):
                    env[layer.index] = env[layer.inputs[0]]
                    continue
                env[layer.index] = layer.module(*[env[i] for i in layer.inputs],
                                                *[batch[k] for k in layer.batch_keys])
            loss = env[len(dec) - 1]
        (loss / count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()) / count)
        done = iteration + 1
        if checkpoint_every and done % checkpoint_every == 0:
            directory = ckpt.checkpoint_path(checkpoint_dir, done)
            ckpt.remove_manifest(directory)
            ckpt.write_layers(directory, dec.layers, aliases, opt)
            meta = {"iterations_done": done, "next_iteration": done, "seed": seed, "plan_version": 0, "job_id": "",
                    "model": model_dict, "optimizer": optimizer["name"], "data": data,
                    "global_batch_size": global_batch_size}
            ckpt.write_manifest(directory, len(dec), meta)
    return losses


def validation_loss(spec: model_pb2.ModelSpec, data: Data, seed: int, global_batch_size: int, batches: int,
                    weights: dict[str, torch.Tensor], user_inputs: UserInputs = NO_USER_INPUTS) -> float:
    """The validation loss of `weights` (the model's own names, an export's) on the job's first `batches`
    validation batches: the whole model in one process, in eval mode, its own `forward`."""
    from services.executor.train.weights import assign

    model = build_model(spec, seed=0, user_inputs=user_inputs)
    assign(model, spec, weights)
    model.eval()
    total, labels = 0.0, 0
    with torch.no_grad():
        for b in range(batches):
            batch = validation_batch_for(spec, data, seed, b, 0, global_batch_size, global_batch_size=global_batch_size,
                                         user_inputs=user_inputs)
            total += float(model(batch).double())
            labels += model.loss_count(batch)
    return total / max(labels, 1)
