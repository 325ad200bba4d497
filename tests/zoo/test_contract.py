"""The rules a user's model keeps (zoo/contract.py, docs/models.md), each broken once: the check names the rule
and the fix, as ProfilerService.Inspect answers at Submit. And what it reports of a model that keeps them."""

from __future__ import annotations

import textwrap

import pytest

from ballast.v1 import model_pb2
from services.runtime.errors import InvalidArgument
from services.specs.user_inputs import UserInputs
from services.zoo.contract import inspect_model
from tests.user_model_support import hf_spec

GOOD = '''
    import torch
    from torch import nn


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(4, 8)
            self.second = nn.Sequential(nn.Tanh(), nn.Linear(8, 3))

        def example_input(self, batch_size, generator):
            return {"x": torch.randn(batch_size, 4, generator=generator),
                    "labels": torch.randint(3, (batch_size,), generator=generator)}
'''

BROKEN = {
    "chain": ("self.second = nn.Sequential(nn.Tanh(), nn.Linear(8, 3))",
              "self.second = nn.Sequential(nn.Tanh(), nn.Linear(5, 3))",
              "failed at child 'second' (on the output of 'first')", "registration order"),
    "no_example": ("def example_input(self", "def other(self", "defines no example_input", "example_input"),
    "example_keys": ('"labels": torch.randint', '"targets": torch.randint', "must return a dict with 'x' and 'labels'",
                     "{'x': inputs, 'labels': targets}"),
    "batch_dim": ('"x": torch.randn(batch_size, 4, generator=generator)', '"x": torch.randn(4, generator=generator)',
                  "first dimension is the batch", "stack batch_size samples"),
    "loss": ("    def example_input(self", "    def loss(self, out, labels):\n            return out\n\n"
             "        def example_input(self", "the loss is shape (2, 3)", "reduction='sum'"),
    "stray_parameter": ("self.first = nn.Linear(4, 8)", "self.first = nn.Linear(4, 8)\n"
                        "            self.scale = nn.Parameter(torch.ones(1))", "parameters outside every layer", ""),
    "meta": ("self.second = nn.Sequential(nn.Tanh(), nn.Linear(8, 3))",
             "self.second = nn.Sequential(nn.Tanh(), nn.Linear(8, 3))\n            self.third = Peek()",
             "cannot run on the meta device", ".item()"),
    "import": ("import torch", "import torch\n    raise RuntimeError('my module is broken')",
               "raised RuntimeError: my module is broken", "importable"),
}
PEEK = '''

    class Peek(nn.Module):
        def forward(self, x):
            return x * float(x.sum())
'''


def user_model(tmp_path, source: str, module: str) -> tuple[model_pb2.ModelSpec, UserInputs]:
    """The model in its own file (a module name of its own: a process imports a module once)."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source) + textwrap.dedent(PEEK) +
                                           "\n\ndef build():\n    return Model()\n")
    spec = model_pb2.ModelSpec(name="mine", family=model_pb2.MODEL_FAMILY_CUSTOM,
                               custom=model_pb2.CustomModel(factory=f"{module}:build", cut_points=["first"]))
    return spec, UserInputs.of([f"{module}:build"], [str(tmp_path)])


def test_a_model_that_keeps_the_rules_is_listed_layer_by_layer(tmp_path):
    spec, user_inputs = user_model(tmp_path, GOOD, "contract_good")
    inspection = inspect_model(spec, user_inputs)
    assert [(x.name, x.kind, x.parameter_count, list(x.output_shape)) for x in inspection.layers] == [
        ("first", "segment", 4 * 8 + 8, [2, 8]), ("second", "segment", 8 * 3 + 3, [])]
    assert inspection.parameter_count == 40 + 27 and inspection.signature
    assert [list(x.batch_keys) for x in inspection.layers] == [["x"], ["labels"]]


@pytest.mark.parametrize("rule", sorted(BROKEN))
def test_each_broken_rule_is_named_with_its_fix(tmp_path, rule):
    old, new, words, fix = BROKEN[rule]
    assert old in GOOD
    spec, user_inputs = user_model(tmp_path, GOOD.replace(old, new, 1), f"contract_{rule}")
    with pytest.raises(InvalidArgument) as err:
        inspect_model(spec, user_inputs)
    assert words in err.value.message, err.value
    assert fix in (err.value.fix or ""), err.value
    assert err.value.field in ("spec", "spec.custom.factory")


def test_a_model_file_that_is_not_on_the_model_path_says_where_to_put_it(tmp_path):
    spec, _ = user_model(tmp_path, GOOD, "contract_elsewhere")
    with pytest.raises(InvalidArgument) as err:
        inspect_model(spec, UserInputs.of(["contract_elsewhere:build"], [str(tmp_path / "elsewhere")]))
    assert "cannot import 'contract_elsewhere'" in err.value.message and "BALLAST_MODEL_PATH" in err.value.fix
    with pytest.raises(InvalidArgument) as err:
        inspect_model(spec, UserInputs.of([], [str(tmp_path)]))
    assert err.value.field == "spec.custom.factory" and "BALLAST_ALLOWED_MODEL_FACTORIES" in err.value.fix


def test_a_hugging_face_model_is_listed_with_its_splits_and_ties():
    inspection = inspect_model(hf_spec("gpt2"), UserInputs())
    assert [x.name for x in inspection.layers] == ["embed", "block.0", "block.1", "head"]
    assert list(inspection.layers[0].tied_with) == [3] and list(inspection.layers[1].output_shape) == [2, 16, 32]
    assert [x.tensor_parallel for x in inspect_model(hf_spec("llama"), UserInputs()).layers] == [0, 2, 2, 0]


def test_a_segment_passes_its_childs_sequence_parallel_protocol_on():
    """A user's block that declares keyword regions and wants its sequence parts told (train/hybrid.py) keeps
    both through the segment Ballast wraps it in; a block that cannot be TP reports no SP ways either."""
    import torch
    from torch import nn

    from services.zoo.base import Block
    from services.zoo.custom import Segment
    from services.zoo.graph import Layer

    class Keyworded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.parts = nn.Linear(4, 4), 1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x)

        def tensor_parallel_plan(self) -> dict[str, str]:
            return {"attn": "colwise"}

        def tensor_parallel_ways(self) -> int:
            return 4

        def sequence_parallel_regions(self) -> dict[str, str | int]:
            return {"attn": "hidden_states"}

        def sequence_parallel_ways(self) -> int:
            return 2

        def prepare_sequence_parallel(self, parts: int) -> None:
            self.parts = parts

    child = Keyworded()
    segment = Segment([child], None)
    assert segment.sequence_parallel_regions() == {"parts.0.attn": "hidden_states"}
    segment.prepare_sequence_parallel(2)
    assert child.parts == 2
    assert Layer(1, "block", "segment", segment, (0,)).sequence_parallel == 2
    dropout = Block(32, 4, 128, 0.1, pre_norm=True, tokens=16)  # no TP with dropout: no SP ways either
    assert Layer(1, "block.0", "block", dropout, (0,)).sequence_parallel == 0
