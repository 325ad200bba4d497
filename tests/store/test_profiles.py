"""Models and profiles: content-addressed models, profiles that read back exactly as they were sent."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from ballast.v1 import common_pb2, model_pb2, profile_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.errors import AlreadyExists, InvalidArgument
from tests.store_builders import detailed_profile_msg, gpt, page, profile_msg
from tests.store_fixtures import FACTORY, Store


def test_model_round_trip_filters_and_paging(store: Store):
    a = store.as_(store.a)
    made = [a.create_model(store_pb2.CreateModelRequest(spec=gpt(f"gpt-{i}", layers=i + 1))) for i in range(5)]
    vit = model_pb2.ModelSpec(
        name="vit",
        family=model_pb2.MODEL_FAMILY_VIT,
        vision=model_pb2.VisionConfig(
            image_size=32, patch_size=8, channels=3, num_classes=10, hidden_size=64, num_layers=2, num_heads=4
        ),
    )
    a.create_model(store_pb2.CreateModelRequest(spec=vit))
    got = a.get_model(store_pb2.GetRequest(id=made[0].id))
    assert got == made[0] and got.spec == gpt("gpt-0", layers=1) and got.id.startswith("mdl-")
    assert len(got.signature) == 64 and got.tenant_id == store.a.tenant_id

    gpts = store_pb2.ListModelsRequest(family=model_pb2.MODEL_FAMILY_GPT, page=page(2))
    seen, pages = [], 0
    while True:
        resp = a.list_models(gpts)
        seen += [m.spec.name for m in resp.models]
        pages += 1
        if not resp.next_page_token:
            break
        gpts.page.page_token = resp.next_page_token
    assert seen == [f"gpt-{i}" for i in range(5)] and pages == 3
    assert [m.spec.name for m in a.list_models(store_pb2.ListModelsRequest(name="vit")).models] == ["vit"]
    with pytest.raises(InvalidArgument) as err:
        a.list_models(store_pb2.ListModelsRequest(page=page(2, "not-a-token")))
    assert err.value.field == "page.page_token"

    # Same spec and name: idempotent. Same spec, other name: refused. Same name, other spec: the name's next
    # version (a model that failed is never a dead end), and the first version is still there.
    assert a.create_model(store_pb2.CreateModelRequest(spec=gpt("gpt-0", layers=1))).id == made[0].id
    with pytest.raises(AlreadyExists) as err:
        a.create_model(store_pb2.CreateModelRequest(spec=gpt("other", layers=1)))
    assert err.value.field == "spec"
    second = a.create_model(store_pb2.CreateModelRequest(spec=gpt("gpt-0", layers=9)))
    assert (made[0].version, second.version, second.spec.transformer.num_layers) == (1, 2, 9)
    assert a.create_model(store_pb2.CreateModelRequest(spec=gpt("gpt-0", layers=9))).id == second.id
    versions = a.list_models(store_pb2.ListModelsRequest(name="gpt-0")).models
    assert [(v.id, v.version) for v in versions] == [(made[0].id, 1), (second.id, 2)]
    with pytest.raises(InvalidArgument) as err:
        a.create_model(store_pb2.CreateModelRequest(spec=gpt(hidden=66)))
    assert err.value.field == "spec.transformer.num_heads"
    custom = model_pb2.ModelSpec(
        name="c", family=model_pb2.MODEL_FAMILY_CUSTOM, custom=model_pb2.CustomModel(factory="evil.mod:run")
    )
    with pytest.raises(InvalidArgument) as err:
        a.create_model(store_pb2.CreateModelRequest(spec=custom))
    assert err.value.field == "spec.custom.factory" and "BALLAST_ALLOWED_MODEL_FACTORIES" in str(err.value)
    custom.custom.factory = FACTORY
    custom.custom.kwargs.update({"width": 8, "tag": "x"})
    assert a.create_model(store_pb2.CreateModelRequest(spec=custom)).spec == custom


def test_profile_round_trip_and_filters(store: Store):
    a = store.as_(store.a)
    model = a.create_model(store_pb2.CreateModelRequest(spec=gpt()))
    sent = profile_msg(model.id)
    prof = a.create_profile(store_pb2.CreateProfileRequest(profile=sent))
    gpu = a.create_profile(store_pb2.CreateProfileRequest(profile=profile_msg(model.id, kind="nvidia-h100")))
    got = a.get_profile(store_pb2.GetRequest(id=prof.id))
    assert got == prof and got.id.startswith("prf-") and got.model_signature == model.signature
    expected = profile_pb2.Profile()
    expected.CopyFrom(sent)
    expected.id, expected.tenant_id, expected.model_signature = got.id, store.a.tenant_id, model.signature
    expected.created_at.CopyFrom(got.created_at)
    assert got == expected
    assert a.get_model(store_pb2.GetRequest(id=model.id)).parameter_count == 1000 + 1001

    def ids(**kw):
        return [p.id for p in a.list_profiles(store_pb2.ListProfilesRequest(**kw)).profiles]

    assert ids() == [prof.id, gpu.id]
    assert ids(device_kind="nvidia-h100") == [gpu.id]
    assert ids(model_id=model.id, model_signature=model.signature, device_kind="cpu") == [prof.id]
    assert ids(model_signature="0" * 64) == []

    bad = profile_msg(model.id)
    bad.layers[1].index = 5
    with pytest.raises(InvalidArgument) as err:
        a.create_profile(store_pb2.CreateProfileRequest(profile=bad))
    assert err.value.field == "profile.layers[1].index"
    assert store.count("profiles") == 2 and store.count("profile_layers") == 4


def test_profile_details_round_trip(store: Store):
    a = store.as_(store.a)
    model = a.create_model(store_pb2.CreateModelRequest(spec=gpt()))
    sent = detailed_profile_msg(model.id)
    prof = a.create_profile(store_pb2.CreateProfileRequest(profile=sent))
    expected = profile_pb2.Profile()
    expected.CopyFrom(sent)
    expected.id, expected.tenant_id, expected.model_signature = prof.id, store.a.tenant_id, model.signature
    expected.created_at.CopyFrom(prof.created_at)
    got = a.get_profile(store_pb2.GetRequest(id=prof.id))
    listed = a.list_profiles(store_pb2.ListProfilesRequest()).profiles
    for out in (prof, got, listed[0]):
        assert out == expected
    assert list(got.measured_micro_batch_sizes) == [1, 4] and got.memory_cap_bytes == (1 << 63) - 1
    assert [pt.op for pt in got.memory_trace] == ["aten::embedding", "aten::mm", "aten::add_"]
    assert got.memory_trace[1].non_model_bytes == (1 << 63) - 1 and got.profiling_time_s == 12.5
    assert [f.collective for f in got.comm.fits] == ["allreduce", "p2p"] and got.comm.fits[0].r2 == 0.999
    assert list(got.comm.unsupported) == list(sent.comm.unsupported)
    assert [(ly.note, ly.measured_as, ly.batch_input_bytes, ly.max_micro_batch_size) for ly in got.layers] == [
        (sent.layers[0].note, 0, 256, 4),
        ("", 1, 0, 2**31 - 1),
        ("reused block.1", 1, (1 << 63) - 1, 0),
    ]
    assert [ly.tensor_parallel for ly in got.layers] == [0, 4, 0]
    assert [ly.sequence_parallel for ly in got.layers] == [0, 2, 0]
    with store.engine.connect() as conn:  # an empty note is stored as NULL, like other optional text
        notes = conn.execute(
            sa.text(f"SELECT layer_index, note FROM profile_layers WHERE profile_id = '{prof.id}' ORDER BY 1")
        ).all()
    assert [n for _, n in notes] == [sent.layers[0].note, None, "reused block.1"]

    plain = a.create_profile(store_pb2.CreateProfileRequest(profile=profile_msg(model.id)))
    bare = a.get_profile(store_pb2.GetRequest(id=plain.id))  # unset details read back as empty
    assert not bare.memory_trace and not bare.measured_micro_batch_sizes and not bare.comm.fits
    assert bare.memory_cap_bytes == 0 and bare.profiling_time_s == 0.0 and not bare.comm.unsupported
    assert all((ly.note, ly.measured_as, ly.batch_input_bytes, ly.max_micro_batch_size, ly.tensor_parallel)
               == ("", 0, 0, 0, 0) for ly in bare.layers)  # fmt: skip


def test_profile_details_out_of_range_are_invalid_argument(store: Store):
    a = store.as_(store.a)
    model = a.create_model(store_pb2.CreateModelRequest(spec=gpt()))

    def bad(field: str, change: Callable[[profile_pb2.Profile], Any]) -> None:
        pr = detailed_profile_msg(model.id)
        change(pr)
        with pytest.raises(InvalidArgument) as err:
            a.create_profile(store_pb2.CreateProfileRequest(profile=pr))
        assert err.value.field == field and err.value.fix, (field, str(err.value))

    bad("profile.memory_cap_bytes", lambda pr: setattr(pr, "memory_cap_bytes", 2**64 - 1))
    bad("profile.profiling_time_s", lambda pr: setattr(pr, "profiling_time_s", math.nan))
    bad("profile.profiling_time_s", lambda pr: setattr(pr, "profiling_time_s", math.inf))
    bad("profile.layers[1].measured_as", lambda pr: setattr(pr.layers[1], "measured_as", 2**32 - 1))
    bad("profile.layers[0].batch_input_bytes", lambda pr: setattr(pr.layers[0], "batch_input_bytes", 2**64 - 1))
    bad("profile.layers[2].max_micro_batch_size", lambda pr: setattr(pr.layers[2], "max_micro_batch_size", 2**31))
    bad("profile.layers[0].note", lambda pr: setattr(pr.layers[0], "note", "a\x00b"))
    assert store.count("profiles") == 0 and store.count("profile_layers") == 0


def test_profile_list_filters_dtype_software_projected(store: Store):
    a, b = store.as_(store.a), store.as_(store.b)
    model = a.create_model(store_pb2.CreateModelRequest(spec=gpt()))

    def create(who: Principal = store.a, model_id: str = model.id, kind: str = "cpu", **kw) -> str:
        pr = profile_msg(model_id, kind=kind)
        for key, value in kw.items():
            setattr(pr, key, value)
        return store.as_(who).create_profile(store_pb2.CreateProfileRequest(profile=pr)).id

    fp32 = create()
    bf16 = create(dtype=common_pb2.DTYPE_BF16)
    newer = create(software="torch 2.14.0")
    projected = create(kind="nvidia-h100", projected=True, source_profile_id=fp32)
    projected_cpu = create(projected=True, source_profile_id=fp32)
    other_model = create(model_id=a.create_model(store_pb2.CreateModelRequest(spec=gpt("other", 4))).id)
    b_model = b.create_model(store_pb2.CreateModelRequest(spec=gpt()))
    other_tenant = create(store.b, b_model.id)

    def ids(who: Principal = store.a, **kw) -> list[str]:
        return [p.id for p in store.as_(who).list_profiles(store_pb2.ListProfilesRequest(**kw)).profiles]

    everything = [fp32, bf16, newer, projected, projected_cpu, other_model]
    assert ids() == everything
    assert ids(dtype=common_pb2.DTYPE_FP32) == [fp32, newer, projected, projected_cpu, other_model]
    assert ids(dtype=common_pb2.DTYPE_BF16) == [bf16]
    assert ids(dtype=common_pb2.DTYPE_FP16) == []
    assert ids(software="torch 2.14.0") == [newer]
    assert ids(software="torch 2.13.0") == [fp32, bf16, projected, projected_cpu, other_model]
    assert ids(software="torch") == []  # exact match, not a prefix
    assert ids(projected=True) == [projected, projected_cpu]
    assert ids(projected=False) == [fp32, bf16, newer, other_model]  # False filters; unset means both
    assert ids(dtype=common_pb2.DTYPE_UNSPECIFIED, software="") == everything  # proto3 defaults filter nothing

    # The profiler's cache lookup: tenant's model signature + device kind + dtype + software, measured only.
    lookup = dict(
        model_signature=model.signature, device_kind="cpu", dtype=common_pb2.DTYPE_FP32,
        software="torch 2.13.0", projected=False,
    )  # fmt: skip
    assert ids(**lookup) == [fp32]
    assert ids(store.b, **lookup) == [other_tenant]  # same signature, another tenant's own profile
    assert ids(store.admin, **lookup) == [fp32, other_tenant]
    with pytest.raises(InvalidArgument) as err:
        ids(dtype=99)
    assert err.value.field == "dtype"
