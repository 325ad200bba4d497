"""Single-process reference run: the whole model, one process, the same data, seed and optimizer.

Harmony §5.4's correctness test: a pipelined, data-parallel run must reproduce these per-iteration losses.
The loss of an iteration is the summed loss of the global batch divided by its label count, computed by the
model's own `forward` (not the layer-by-layer path), so the reference also checks the decomposition.
"""

from __future__ import annotations

from typing import Any

import torch
from google.protobuf.json_format import MessageToDict

from ballast.v1 import model_pb2
from services.executor.train import checkpoint as ckpt
from services.executor.train.data import batch_for, dropout_seed
from services.executor.train.stage import make_optimizer, tied_aliases
from services.zoo import build_model


def train_single(
    spec: model_pb2.ModelSpec,
    data: dict[str, Any],
    seed: int,
    global_batch: int,
    iterations: int,
    optimizer: dict[str, Any],
    *,
    start_iteration: int = 0,
    resume_from: str = "",
    checkpoint_dir: str = "",
    checkpoint_every: int = 0,
    device: str = "cpu",
) -> list[float]:
    """Mean losses of iterations start..iterations-1 (resumed iterations start at the checkpoint's)."""
    model = build_model(spec, seed=seed, device=device)
    model.train()
    dec = model.decompose()
    aliases = tied_aliases(model, dec, 0, len(dec))
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
                 batch_for(spec, data, seed, iteration, 0, global_batch, global_batch=global_batch).items()}
        count = max(model.loss_count(batch), 1)
        torch.manual_seed(dropout_seed(seed, iteration, 0))
        loss = model(batch)
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
                    "model": model_dict, "optimizer": optimizer["name"], "data": data, "global_batch": global_batch}
            ckpt.write_manifest(directory, len(dec), meta)
    return losses
