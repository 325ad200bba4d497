"""User models: an operator-allow-listed factory, cut into pipeline segments at named cut-points.

Protocol (Varuna §5.1, with cut-points named in the spec instead of found by profiling; docs/models.md is the
user's version): the factory `pkg.module:callable(**kwargs)` returns an nn.Module whose top-level children, run
in registration order, map `batch["x"]` to the output (the module's own `forward` is not used). The module may
define `loss(output, labels) -> Tensor` (summed over samples; default: summed cross-entropy) and must define
`example_input(batch_size, generator) -> {"x": ..., "labels": ...}` to be profiled. Each cut-point names a child
after which a segment ends; parameters used by several segments are found and declared. The factory is imported
only after `validate_model_spec` has checked it against the allow-list, from the import path plus the
operator's model directories (BALLAST_MODEL_PATH). zoo.contract checks the rest before a job is accepted.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import Tensor, nn

from ballast.v1 import model_pb2
from services.runtime.errors import InvalidArgument
from services.specs.user_inputs import MODEL_PATH_FIX, UserInputs
from services.zoo.base import CutModel, struct_values, sum_cross_entropy
from services.zoo.graph import Layer, LayerList, sequence_regions

FIELD = "spec.custom"


def load_factory(path: str, user_inputs: UserInputs) -> Callable[..., nn.Module]:
    """Import "pkg.module:callable"; call only with a path the allow-list already admitted."""
    module_name, _, attr = path.partition(":")
    user_inputs.importable()
    try:
        target = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise InvalidArgument(f"cannot import {module_name!r} for factory {path!r}: {exc}", field=f"{FIELD}.factory",
                              fix=f"{MODEL_PATH_FIX.replace('give its absolute path', 'or install it')} "
                                  f"(model directories here: {list(user_inputs.path)})") from exc
    except Exception as exc:  # the user's module raised while it was imported
        raise InvalidArgument(f"importing {module_name!r} raised {type(exc).__name__}: {exc}",
                              field=f"{FIELD}.factory", fix="make the module importable on its own") from exc
    try:
        for part in attr.split("."):
            target = getattr(target, part)
    except AttributeError as exc:
        raise InvalidArgument(f"cannot load factory {path!r}: {exc}", field=f"{FIELD}.factory",
                              fix=f"define {attr!r} in {module_name!r}") from exc
    if not callable(target):
        raise InvalidArgument(f"factory {path!r} is not callable", field=f"{FIELD}.factory")
    return target


def factory_kwargs(cfg: model_pb2.CustomModel) -> dict:
    """The factory's keyword arguments; `width: 16` reaches it as the int 16 (base.struct_values)."""
    return struct_values(cfg.kwargs) if cfg.HasField("kwargs") else {}


class Segment(nn.Module):
    """Consecutive children of the user model; the last segment also computes the loss. A segment of one child
    that keeps the executors' TP protocol (train/hybrid.py: `tensor_parallel_plan`, `tensor_parallel_ways`) can
    be split tensor-parallel as that child declares."""

    def __init__(self, children: list[nn.Module], loss: Callable[[Tensor, Tensor], Tensor] | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(children)
        self.loss = loss

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        for part in self.parts:
            x = part(x)
        return x if self.loss is None else self.loss(x, labels)

    def _declared(self, name: str) -> Callable | None:
        """The single child's TP method `name`, if this segment is one child that declares it (never the loss's)."""
        method = getattr(self.parts[0], name, None) if len(self.parts) == 1 and self.loss is None else None
        return method if callable(method) else None

    def tensor_parallel_plan(self) -> dict[str, str]:
        plan = self._declared("tensor_parallel_plan")
        return {f"parts.0.{path}": style for path, style in plan().items()} if plan else {}

    def tensor_parallel_ways(self) -> int:
        ways = self._declared("tensor_parallel_ways")
        return int(ways()) if ways and self.tensor_parallel_plan() else 0

    def sequence_parallel_ways(self) -> int:
        ways = self._declared("sequence_parallel_ways")
        return int(ways()) if ways and self.tensor_parallel_plan() else 0

    def sequence_parallel_regions(self) -> dict[str, str | int]:
        """The child's regions (a list of paths, or paths -> the argument holding their hidden states)."""
        if not self._declared("sequence_parallel_regions"):
            return {}
        return {f"parts.0.{path}": arg for path, arg in sequence_regions(self.parts[0]).items()}

    def prepare_sequence_parallel(self, parts: int) -> None:
        prepare = self._declared("prepare_sequence_parallel")
        if prepare:
            prepare(parts)

    def prepare_tensor_parallel(self) -> None:
        prepare = self._declared("prepare_tensor_parallel")
        if prepare:
            prepare()

    def tensor_parallel_rows(self, name: str, value: Tensor, sharded: bool) -> Tensor:
        rows = self._declared("tensor_parallel_rows")
        return rows(name.removeprefix("parts.0."), value, sharded) if rows else value


class CustomZooModel(CutModel):
    def __init__(self, spec: model_pb2.ModelSpec, user_inputs: UserInputs) -> None:
        super().__init__(spec)
        cfg = spec.custom
        factory = load_factory(cfg.factory, user_inputs)
        try:
            inner = factory(**factory_kwargs(cfg))
        except Exception as exc:  # the user's code: its error is the answer
            raise InvalidArgument(f"factory {cfg.factory!r} raised {type(exc).__name__}: {exc}",
                                  field=f"{FIELD}.kwargs", fix="pass kwargs the factory accepts") from exc
        if not isinstance(inner, nn.Module) or not list(inner.children()):
            raise InvalidArgument(
                f"factory {cfg.factory!r} must return an nn.Module with child modules", field=f"{FIELD}.factory",
                fix="return the model whose top-level children run in order (docs/models.md)")
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

    def example_input(self, batch_size: int, generator) -> dict[str, Tensor]:
        if not callable(getattr(self.inner, "example_input", None)):
            raise InvalidArgument("the factory's model defines no example_input", field=f"{FIELD}.factory",
                                  fix="define example_input(batch_size, generator) returning {'x': ..., 'labels': ...}"
                                      " drawn from the generator (docs/models.md)")
        return self.inner.example_input(batch_size, generator)

    def cut(self) -> list[Layer]:
        """One layer per segment, named after its children ("embed", or "hidden0..hidden2" for several)."""
        named, out, start = list(self.inner.named_children()), LayerList(), 0
        for s, end in enumerate(self.bounds):
            last = end == len(named)
            keys = (("x",) if s == 0 else ()) + (("labels",) if last else ())
            names, children = zip(*named[start:end], strict=True)
            segment = Segment(list(children), self.loss_fn if last else None)
            name = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
            out.add(name, "segment", segment, batch_keys=keys, inputs=() if s == 0 else None)
            start = end
        return out.layers
