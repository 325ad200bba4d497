"""Every number a client sends has a documented range, checked at the first service that sees it (issue 41, item
3): non-finite, negative and absurd values are INVALID_ARGUMENT naming the field and the range, nothing written."""

from __future__ import annotations

import math
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor

from ballast.errors import CallFailed
from ballast.v1 import fleet_pb2, job_pb2, model_pb2, services_pb2
from services.runtime.errors import InvalidArgument
from services.specs import ranges
from services.specs.model import validate_job_spec
from tests.harness import ROOT, make_settings, start_plane

U32 = 2**32 - 1
REQUESTS = (services_pb2.SubmitJobRequest, services_pb2.ProfileRequest, services_pb2.PlanRequest,
            services_pb2.ProjectProfileRequest)
NUMBERS = ranges._FLOATS + ranges._INTEGERS


def numeric_fields(descriptor, seen: set[str]) -> set[str]:
    if descriptor.full_name in seen or descriptor.full_name.startswith("google.protobuf."):
        return set()
    seen.add(descriptor.full_name)
    found = set()
    for field in descriptor.fields:
        if field.type in NUMBERS:
            found.add(f"{descriptor.name}.{field.name}")
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            found |= numeric_fields(field.message_type, seen)
    return found


def test_every_number_a_client_sends_has_a_range_and_every_range_a_field() -> None:
    seen: set[str] = set()
    sent = set().union(*(numeric_fields(r.DESCRIPTOR, seen) for r in REQUESTS))
    assert sent - set(ranges.RANGES) == set()
    assert set(ranges.RANGES) - sent == set()
    for key, rule in ranges.RANGES.items():
        assert 0 <= rule.low <= rule.high and math.isfinite(rule.high), key


def test_docs_limits_is_the_table() -> None:
    text = (ROOT / "docs" / "limits.md").read_text()
    assert ranges.markdown() in text


def tiny(**transformer) -> model_pb2.ModelSpec:
    config = dict(num_layers=2, hidden_size=32, num_heads=2, vocab_size=128, seq_length=16) | transformer
    return model_pb2.ModelSpec(name="ranged", family=model_pb2.MODEL_FAMILY_GPT,
                               transformer=model_pb2.TransformerConfig(**config))


def job(**fields) -> job_pb2.JobSpec:
    fields.setdefault("model", tiny())
    return job_pb2.JobSpec(name="ranged", global_batch_size=4, iterations=2, **fields)


def fleet(device: dict | None = None, intra: dict | None = None) -> fleet_pb2.Fleet:
    return fleet_pb2.Fleet(device=fleet_pb2.DeviceSpec(kind="cpu", memory_bytes=8 << 30, **(device or {})),
                           devices_per_node=2, nodes=1, intra_node=fleet_pb2.Link(**(intra or {"latency_s": 1e-6})))


def vit(**vision) -> model_pb2.ModelSpec:
    config = dict(image_size=32, patch_size=8, channels=3, num_classes=10, hidden_size=32, num_layers=2,
                  num_heads=2) | vision
    return model_pb2.ModelSpec(name="ranged-vit", family=model_pb2.MODEL_FAMILY_VIT,
                               vision=model_pb2.VisionConfig(**config))


BAD_JOBS = {  # the probe's inputs (issue 41) and their field paths
    "spec.optimizer.learning_rate": job(optimizer=job_pb2.OptimizerSpec(learning_rate=math.inf)),
    "spec.model.vision.mlp_ratio": job(model=vit(mlp_ratio=1e308)),
    "spec.fleet.device.peak_flops": job(fleet=fleet({"peak_flops": math.nan})),
    "spec.fleet.device.memory_bandwidth_bytes_per_s": job(fleet=fleet({"memory_bandwidth_bytes_per_s": math.inf})),
    "spec.fleet.intra_node.bandwidth_bytes_per_s": job(fleet=fleet(intra={"bandwidth_bytes_per_s": -1e9})),
    "spec.fleet.intra_node.latency_s": job(fleet=fleet(intra={"latency_s": -1})),
    "spec.layer_toggles[0].layer_index": job(layer_toggles=[job_pb2.LayerToggle(layer_index=U32, iteration=1)]),
    "spec.min_devices": job(min_devices=U32),
    "spec.max_devices": job(max_devices=U32),
    "spec.model.transformer.hidden_size": job(model=tiny(hidden_size=U32)),
    "spec.model.transformer.vocab_size": job(model=tiny(vocab_size=U32)),
}


@pytest.mark.parametrize("field", BAD_JOBS)
def test_a_number_out_of_range_names_its_field_and_range(field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_job_spec(BAD_JOBS[field])
    assert err.value.field == field
    assert "docs/limits.md" in err.value.fix and "[" in err.value.fix


def test_zero_keeps_its_meaning_and_a_hugging_face_config_must_be_finite() -> None:
    validate_job_spec(job(fleet=fleet({"peak_flops": 0})))  # 0: unknown, the catalog's figure is used
    spec = job_pb2.JobSpec(global_batch_size=4, iterations=2, model=model_pb2.ModelSpec(
        name="hf", family=model_pb2.MODEL_FAMILY_HF, hf=model_pb2.HuggingFaceModel(seq_length=8)))
    spec.model.hf.config.update({"model_type": "gpt2", "n_embd": math.inf})
    with pytest.raises(InvalidArgument) as err:
        ranges.check_bounds(spec, "spec")
    assert err.value.field == "spec.model.hf.config.n_embd"


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    plane = start_plane(make_settings(tmp_path_factory.mktemp("ranges")), send=lambda request_id: None)
    yield plane
    plane.stop()


def written(plane) -> tuple[int, ...]:
    with plane.client() as client:
        row = client.sql("SELECT (SELECT count(*) FROM models), (SELECT count(*) FROM jobs), "
                         "(SELECT count(*) FROM queued_requests), (SELECT count(*) FROM profiles)").rows[0]
    return tuple(int(v) for v in row)


def refused(call, field: str) -> None:
    with pytest.raises((CallFailed, grpc.RpcError)) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert field in err.value.details() and "docs/limits.md" in err.value.details(), err.value.details()


def test_submit_profile_and_plan_refuse_them_over_grpc_and_write_nothing(plane, tmp_path: Path) -> None:
    before = written(plane)
    with plane.client() as client:
        for field, spec in BAD_JOBS.items():
            refused(lambda spec=spec: client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec)), field)
        # The probe's Profile ran 17 s into a MemoryError; now it is refused before a model is even stored.
        refused(lambda: client.profiler.Profile(services_pb2.ProfileRequest(
            model=tiny(), max_micro_batch_size=U32)), "max_micro_batch_size")
        refused(lambda: client.profiler.Profile(services_pb2.ProfileRequest(
            model=tiny(), options=services_pb2.ProfileOptions(micro_batch_sizes=[1, U32]))),
            "options.micro_batch_sizes[1]")
        refused(lambda: client.planner.Plan(services_pb2.PlanRequest(
            profile_id="p-any", fleet=fleet({"peak_flops": -1}))), "fleet.device.peak_flops")
        refused(lambda: client.planner.WhatIf(services_pb2.PlanRequest(
            profile_id="p-any", fleet=fleet(intra={"latency_s": math.nan}))), "fleet.intra_node.latency_s")
        refused(lambda: client.profiler.ProjectProfile(services_pb2.ProjectProfileRequest(
            profile_id="p-any", device=fleet_pb2.DeviceSpec(kind="A100-80GB", peak_flops=math.inf))),
            "device.peak_flops")
    assert written(plane) == before
