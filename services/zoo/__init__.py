"""Model zoo shared by the profiler and the executor.

`build_model(spec)` gives a plain nn.Module whose `forward(batch)` returns the summed loss and whose
`decompose()` lists the layers (embedding, blocks, head) that run one at a time, with the extra
edges, relayed outputs and shared Parameters a pipeline must honour. `count_parameters(spec)` builds
on the meta device, so even a 15B-parameter spec costs no memory.
"""

from services.zoo.base import IGNORE_INDEX, ZooModel
from services.zoo.build import (
    FAMILIES,
    build_model,
    causal_lm_shape,
    check_spec,
    count_parameters,
    example_input,
)
from services.zoo.graph import Decomposition, Inputs, Layer, SharedParameter, run_layers

__all__ = [
    "FAMILIES",
    "IGNORE_INDEX",
    "Decomposition",
    "Inputs",
    "Layer",
    "SharedParameter",
    "ZooModel",
    "build_model",
    "causal_lm_shape",
    "check_spec",
    "count_parameters",
    "example_input",
    "run_layers",
]
