"""Is a model one Ballast can train? Build it on the meta device and run it layer by layer on an example batch,
as the workers will (stage.model_info), and say which rule it breaks and how to fix it.

A user's factory model must: be importable and allow-listed; return an nn.Module whose top-level children, run
in registration order on batch["x"], give the output its `loss(output, labels)` turns into one summed number
(the module's own forward is not used); keep every parameter inside a child; define
`example_input(batch_size, generator)` returning tensors "x" and "labels" whose first dimension is the batch; and
run on the meta device (no data-dependent Python such as `.item()` in forward: stage boundaries are sized by a
meta-device dry run). A Hugging Face model must be an architecture with an adapter (zoo/hf/adapters.py). The
profiler runs this in a worker process at Submit (ProfilerService.Inspect), so a broken model is refused before
anything is stored, not on a worker at iteration 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ballast.v1 import model_pb2
from services.runtime.errors import BallastError, InvalidArgument
from services.specs.model import model_signature
from services.specs.user_inputs import UserInputs
from services.zoo.build import build_model, example_input
from services.zoo.graph import Decomposition

F = model_pb2.ModelFamily
EXAMPLE_BATCH = 2
CHAIN_FIX = ("Ballast runs the model's top-level children in registration order, each on the previous one's output, "
             "and ignores the module's own forward: register the children in call order, or wrap what does not chain "
             "(a skip connection, several inputs) inside one child (docs/models.md)")
META_FIX = ("stage boundaries are sized by a dry run on the meta device: avoid data-dependent Python in forward "
            "(.item(), .tolist(), branching on values)")


def inspect_model(spec: model_pb2.ModelSpec, user_inputs: UserInputs) -> model_pb2.ModelInspection:
    """The model's layers as Ballast cuts them; InvalidArgument naming the rule it breaks and the fix."""
    field = _field(spec)
    try:
        model = build_model(spec, device="meta", user_inputs=user_inputs)
        dec = model.decompose()
    except BallastError:
        raise
    except Exception as exc:  # the user's constructor or its config
        raise InvalidArgument(f"building the model raised {type(exc).__name__}: {exc}", field=field,
                              fix="make the model build from its spec alone") from exc
    batch = _example(spec, user_inputs, field)
    if spec.family == F.MODEL_FAMILY_CUSTOM:
        _chain_children(model.inner, batch["x"], field)
    outputs = _dry_run(dec, batch, field, custom=spec.family == F.MODEL_FAMILY_CUSTOM)
    counts = {layer.index: sum(p.numel() for p in dict.fromkeys(layer.module.parameters())) for layer in dec.layers}
    return model_pb2.ModelInspection(
        signature=model_signature(spec),
        parameter_count=sum(p.numel() for p in model.parameters()),
        layers=[model_pb2.ModelLayer(index=layer.index, name=layer.name, kind=layer.kind,
                                     parameter_count=counts[layer.index], tensor_parallel=layer.tensor_parallel,
                                     sequence_parallel=layer.sequence_parallel,
                                     tied_with=layer.tied_with, inputs=list(layer.inputs),
                                     batch_keys=list(layer.batch_keys),
                                     output_shape=list(outputs[layer.index].shape)
                                     if layer.index < len(dec) - 1 else [])
                for layer in dec.layers])


def _field(spec: model_pb2.ModelSpec) -> str:
    if spec.family == F.MODEL_FAMILY_CUSTOM:
        return "spec.custom.factory"
    return "spec.hf" if spec.family == F.MODEL_FAMILY_HF else "spec"


def _example(spec: model_pb2.ModelSpec, user_inputs: UserInputs, field: str) -> dict[str, Tensor]:
    try:
        batch = example_input(spec, EXAMPLE_BATCH, user_inputs=user_inputs)
    except BallastError:
        raise
    except Exception as exc:
        raise InvalidArgument(f"example_input({EXAMPLE_BATCH}, generator) raised {type(exc).__name__}: {exc}",
                              field=field, fix="draw the example batch from the generator it is given") from exc
    if spec.family != F.MODEL_FAMILY_CUSTOM:
        return {k: v.to("meta") for k, v in batch.items()}
    if not isinstance(batch, dict) or not {"x", "labels"} <= set(batch):
        raise InvalidArgument(f"example_input returned {_keys(batch)}; it must return a dict with 'x' and 'labels'",
                              field=field, fix="return {'x': inputs, 'labels': targets} for batch_size samples")
    for key, value in batch.items():
        if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != EXAMPLE_BATCH:
            what = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
            raise InvalidArgument(f"example_input({EXAMPLE_BATCH}, ...)[{key!r}] is {what}; each value must be a "
                                  f"tensor whose first dimension is the batch ({EXAMPLE_BATCH})", field=field,
                                  fix="stack batch_size samples along dimension 0")
    return {k: v.to("meta") for k, v in batch.items()}


def _keys(batch: object) -> str:
    return f"keys {sorted(batch)}" if isinstance(batch, dict) else f"a {type(batch).__name__}"


def _chain_children(inner: torch.nn.Module, x: Tensor, field: str) -> None:
    """Each top-level child on the previous one's output: a failure names the child and the one before it."""
    before = "batch['x']"
    with torch.no_grad():
        for name, child in inner.named_children():
            try:
                x = child(x)
            except Exception as exc:
                raise _layer_failed(f"child {name!r} (on the output of {before})", exc, field, custom=True) from exc
            before = repr(name)


def _dry_run(dec: Decomposition, batch: dict[str, Tensor], field: str, *, custom: bool) -> dict[int, Tensor]:
    """Every layer's output on the meta example batch; the last must be the loss, a scalar."""
    env: dict[int, Tensor] = {}
    with torch.no_grad():
        for layer in dec.layers:
            try:
                env[layer.index] = layer.module(*[env[i] for i in layer.inputs],
                                                *[batch[k] for k in layer.batch_keys])
            except Exception as exc:
                raise _layer_failed(layer.name, exc, field, custom) from exc
    loss = env[len(dec) - 1]
    if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.dtype.is_floating_point:
        what = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise InvalidArgument(f"the loss is {what}; it must be one number, summed over the samples", field=field,
                              fix="define loss(output, labels) returning a 0-dimensional tensor with reduction='sum'")
    return env


def _layer_failed(name: str, exc: Exception, field: str, custom: bool) -> InvalidArgument:
    text = f"{type(exc).__name__}: {exc}".strip()
    if "meta" in text.lower() or isinstance(exc, NotImplementedError):
        return InvalidArgument(f"layer {name} cannot run on the meta device ({text[:300]})", field=field, fix=META_FIX)
    if custom:
        return InvalidArgument(f"running the top-level children in order failed at {name}: {text[:300]}",
                               field=field, fix=CHAIN_FIX)
    return InvalidArgument(f"layer {name} failed on an example batch: {text[:300]}", field=field,
                           fix="check the config's sizes (hidden size, heads, sequence length)")
