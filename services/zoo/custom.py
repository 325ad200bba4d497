"""User models: an operator-allow-listed factory, cut into pipeline segments at named cut-points.

Protocol (Varuna §5.1, with cut-points named in the spec instead of found by profiling): the factory
`pkg.module:callable(**kwargs)` returns an nn.Module whose top-level children, run in registration
order, map `batch["x"]` to the output. The module may define `loss(output, labels) -> Tensor`
(summed over samples; default: summed cross-entropy) and must define
`example_input(batch_size, generator) -> {"x": ..., "labels": ...}` to be profiled. Each cut-point
names a child after which a segment ends; parameters used by several segments are found and declared.
The factory is imported only after `validate_model_spec` has checked it against the allow-list.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from google.protobuf.json_format import MessageToDict
from torch import Tensor, nn

from ballast.v1 import model_pb2
from services.runtime.errors import InvalidArgument
from services.zoo.base import ZooModel, sum_cross_entropy
from services.zoo.graph import Inputs, Layer, LayerList

FIELD = "spec.custom"


def load_factory(path: str) -> Callable[..., nn.Module]:
    """Import "pkg.module:callable"; call only with a path the allow-list already admitted."""
    module_name, _, attr = path.partition(":")
    try:
        target = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise InvalidArgument(f"cannot load factory {path!r}: {exc}", field=f"{FIELD}.factory") from exc
    if not callable(target):
        raise InvalidArgument(f"factory {path!r} is not callable", field=f"{FIELD}.factory")
    return target


def factory_kwargs(cfg: model_pb2.CustomModel) -> dict:
    """Struct numbers are doubles; integral ones become ints so `width: 16` reaches the factory as 16."""

    def fix(value):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        return value

    return fix(MessageToDict(cfg.kwargs)) if cfg.HasField("kwargs") else {}


class Segment(nn.Module):
    """Consecutive children of the user model; the last segment also computes the loss."""

    def __init__(self, children: list[nn.Module], loss: Callable[[Tensor, Tensor], Tensor] | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(children)
        self.loss = loss

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        for part in self.parts:
            x = part(x)
        return x if self.loss is None else self.loss(x, labels)


class CustomZooModel(ZooModel):
    def __init__(self, spec: model_pb2.ModelSpec) -> None:
        super().__init__(spec)
        cfg = spec.custom
        inner = load_factory(cfg.factory)(**factory_kwargs(cfg))
        if not isinstance(inner, nn.Module) or not list(inner.children()):
            raise InvalidArgument(
                f"factory {cfg.factory!r} must return an nn.Module with child modules", field=f"{FIELD}.factory"
            )
        self.inner = inner
        self.loss_fn = getattr(inner, "loss", sum_cross_entropy)
        self.bounds = self._bounds(list(cfg.cut_points))

    def _bounds(self, cut_points: list[str]) -> list[int]:
        """Child index where each segment ends (exclusive), from cut-point names in order."""
        names = [name for name, _ in self.inner.named_children()]
        bounds: list[int] = []
        for i, cut in enumerate(cut_points):
            field = f"{FIELD}.cut_points[{i}]"
            if cut not in names:
                raise InvalidArgument(f"{cut!r} is not a child module of the model", field=field, fix=f"one of {names}")
            end = names.index(cut) + 1
            if bounds and end <= bounds[-1]:
                raise InvalidArgument(f"cut point {cut!r} is out of order or repeated", field=field)
            if end == len(names):
                raise InvalidArgument(f"cut point {cut!r} is the last child: it leaves an empty segment", field=field)
            bounds.append(end)
        return [*bounds, len(names)]

    def forward(self, inputs: Inputs) -> Tensor:
        x = inputs["x"]
        for child in self.inner.children():
            x = child(x)
        return self.loss_fn(x, inputs["labels"])

    def example_input(self, batch_size: int, generator) -> dict[str, Tensor]:
        if not hasattr(self.inner, "example_input"):
            raise InvalidArgument("the factory's model defines no example_input", field=f"{FIELD}.factory")
        return self.inner.example_input(batch_size, generator)

    def layer_list(self) -> list[Layer]:
        children, out, start = list(self.inner.children()), LayerList(), 0
        for s, end in enumerate(self.bounds):
            last = end == len(children)
            keys = (("x",) if s == 0 else ()) + (("labels",) if last else ())
            segment = Segment(children[start:end], self.loss_fn if last else None)
            out.add(f"segment.{s}", "segment", segment, batch_keys=keys, inputs=() if s == 0 else None)
            start = end
        return out.layers
