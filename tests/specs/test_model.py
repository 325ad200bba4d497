"""Model spec files load; ModelSpec/JobSpec validation: each rule refuses with the proto path of the bad field."""

from __future__ import annotations

from pathlib import Path

import pytest

from ballast.v1 import fleet_pb2, job_pb2, model_pb2, plan_pb2
from services.runtime.errors import InvalidArgument
from services.specs.model import load_model_spec, model_signature, validate_job_spec, validate_model_spec
from services.specs.user_inputs import UserInputs

F = model_pb2.ModelFamily
FACTORY = "mypkg.models:build"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def transformer(family: int = F.MODEL_FAMILY_GPT, **kw) -> model_pb2.ModelSpec:
    cfg = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "vocab_size": 128, "seq_length": 32} | kw
    return model_pb2.ModelSpec(name="m", family=family, transformer=model_pb2.TransformerConfig(**cfg))


def vision(family: int = F.MODEL_FAMILY_VIT, **kw) -> model_pb2.ModelSpec:
    cfg = {"image_size": 32, "patch_size": 8, "channels": 3, "num_classes": 10, "hidden_size": 64} | kw
    return model_pb2.ModelSpec(name="v", family=family, vision=model_pb2.VisionConfig(**cfg))


def custom(factory: str = FACTORY) -> model_pb2.ModelSpec:
    return model_pb2.ModelSpec(family=F.MODEL_FAMILY_CUSTOM, custom=model_pb2.CustomModel(factory=factory))


def field_of(spec: model_pb2.ModelSpec, allowed: tuple[str, ...] = (FACTORY,)) -> str | None:
    try:
        validate_model_spec(spec, UserInputs.of(allowed))
    except InvalidArgument as err:
        assert err.fix, "every validation error says how to fix it"
        return err.field
    return None


def test_valid_specs_pass():
    for spec in (
        transformer(),
        transformer(F.MODEL_FAMILY_BERT),
        transformer(F.MODEL_FAMILY_T5, num_decoder_layers=2, decoder_seq_length=4),
        vision(num_layers=2, num_heads=4),
        vision(F.MODEL_FAMILY_SWIN, depths=[2, 2], head_dim=32, window_size=4),
        custom(),
    ):
        assert field_of(spec) is None, spec


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (model_pb2.ModelSpec(transformer=model_pb2.TransformerConfig()), "spec.family"),
        (model_pb2.ModelSpec(family=F.MODEL_FAMILY_GPT), "spec.transformer"),
        (vision(F.MODEL_FAMILY_GPT), "spec.transformer"),
        (transformer(F.MODEL_FAMILY_VIT), "spec.vision"),
        (transformer(F.MODEL_FAMILY_CUSTOM), "spec.custom"),
        (transformer(num_layers=0), "spec.transformer.num_layers"),
        (transformer(hidden_size=0), "spec.transformer.hidden_size"),
        (transformer(vocab_size=0), "spec.transformer.vocab_size"),
        (transformer(hidden_size=66), "spec.transformer.num_heads"),
        (transformer(max_positions=8), "spec.transformer.max_positions"),
        (transformer(F.MODEL_FAMILY_T5, decoder_seq_length=4), "spec.transformer.num_decoder_layers"),
        (transformer(F.MODEL_FAMILY_T5, num_decoder_layers=2), "spec.transformer.decoder_seq_length"),
        (vision(num_layers=2, num_heads=0), "spec.vision.num_heads"),
        (vision(num_layers=2, num_heads=5), "spec.vision.num_heads"),
        (vision(patch_size=7, num_layers=2, num_heads=4), "spec.vision.patch_size"),
        (vision(F.MODEL_FAMILY_SWIN), "spec.vision.depths"),
        (vision(F.MODEL_FAMILY_SWIN, depths=[2, 0]), "spec.vision.depths[1]"),
        (vision(F.MODEL_FAMILY_SWIN, depths=[2], head_dim=48), "spec.vision.head_dim"),
        (custom("not a path"), "spec.custom.factory"),
        (custom("mypkg.models"), "spec.custom.factory"),
        (custom("other.mod:build"), "spec.custom.factory"),
    ],
)
def test_invalid_model_specs_name_the_field(spec, field):
    assert field_of(spec) == field


@pytest.mark.parametrize("dropout", [-0.1, 1.0, float("nan")])
def test_dropout_range(dropout):
    spec = transformer()
    spec.dropout = dropout
    assert field_of(spec) == "spec.dropout"
    spec.dropout = 0.1
    assert field_of(spec) is None


def test_custom_factory_needs_the_allow_list():
    with pytest.raises(InvalidArgument) as err:
        validate_model_spec(custom(), UserInputs())
    assert err.value.field == "spec.custom.factory"
    assert err.value.fix == "ask the platform operator to add it to BALLAST_ALLOWED_MODEL_FACTORIES"


def test_job_spec_rules_use_job_paths():
    def job(**kw) -> job_pb2.JobSpec:
        return job_pb2.JobSpec(**({"model": transformer(), "global_batch_size": 8, "iterations": 3} | kw))

    validate_job_spec(job())
    validate_job_spec(job(micro_batches=4))
    validate_job_spec(job(layer_toggles=[job_pb2.LayerToggle(layer_index=2, iteration=0),
                                         job_pb2.LayerToggle(layer_index=2, iteration=2, active=True)]))
    cases = [
        (job_pb2.JobSpec(global_batch_size=8, iterations=3), "spec.model"),
        (job(model=transformer(num_heads=3)), "spec.model.transformer.num_heads"),
        (job(model=custom()), "spec.model.custom.factory"),
        (job(global_batch_size=0), "spec.global_batch_size"),
        (job(iterations=0), "spec.iterations"),
        (job(optimizer=job_pb2.OptimizerSpec(name="lion")), "spec.optimizer.name"),
        (job(fleet=fleet_pb2.Fleet(devices_per_node=1, nodes=1)), "spec.fleet.device.kind"),
        (
            job(fleet=fleet_pb2.Fleet(device=fleet_pb2.DeviceSpec(kind="cpu"), nodes=1)),
            "spec.fleet.devices_per_node",
        ),
        (job(layer_toggles=[job_pb2.LayerToggle(layer_index=2, iteration=3)]), "spec.layer_toggles[0].iteration"),
        (job(layer_toggles=[job_pb2.LayerToggle(layer_index=2, iteration=1),
                            job_pb2.LayerToggle(layer_index=2, iteration=1, active=True)]), "spec.layer_toggles[1]"),
        (job(micro_batches=3), "spec.micro_batches"),  # 3 does not divide the global batch of 8
        (job(micro_batches=4, engine=plan_pb2.PLAN_ENGINE_GALVATRON), "spec.micro_batches"),
    ]
    for spec, field in cases:
        with pytest.raises(InvalidArgument) as err:
            validate_job_spec(spec)
        assert err.value.field == field
    validate_job_spec(job(model=custom()), UserInputs.of([FACTORY]))


def test_signature_ignores_name_only():
    a, b = transformer(), transformer()
    b.name = "renamed"
    assert model_signature(a) == model_signature(b) and len(model_signature(a)) == 64
    assert model_signature(a) != model_signature(transformer(num_layers=3))
    c1, c2 = custom(), custom()
    c1.custom.kwargs.update({"a": 1, "b": 2})
    c2.custom.kwargs.update({"b": 2, "a": 1})
    assert model_signature(c1) == model_signature(c2)


def test_every_example_model_spec_loads_and_validates():
    paths = [p for p in sorted(EXAMPLES.glob("*.yaml")) if not p.name.startswith("fleet-")]
    assert any(p.name == "gpt-tiny.yaml" for p in paths)
    examples = UserInputs.of(["mlp:build"], [str(EXAMPLES / "models")])  # what the example's operator allows
    for path in paths:
        spec = load_model_spec(path)
        assert spec.name, path
        validate_model_spec(spec, examples)
    tiny = load_model_spec(EXAMPLES / "gpt-tiny.yaml")
    assert tiny.family == F.MODEL_FAMILY_GPT and tiny.transformer.num_layers == 4 and tiny.transformer.tie_embeddings
