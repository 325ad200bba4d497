"""Free-form text is bounded by a documented size (issue 41, item 4; docs/limits.md): a request's strings and
Structs are refused past it, and what the store keeps of messages is cut with a marker, never refused, because
the services write their errors there. On SQLite, PostgreSQL and a remote store, and through a real planner."""

from __future__ import annotations

import grpc
import pytest

from ballast.errors import CallFailed
from ballast.v1 import job_pb2, model_pb2, services_pb2, store_pb2
from services.runtime.errors import InvalidArgument
from services.specs.model import validate_job_spec
from services.specs.ranges import MAX_MESSAGE_CHARS, MAX_PAYLOAD_BYTES, MAX_TEXT_BYTES
from tests.harness import make_settings, start_plane
from tests.store_fixtures import JS, Store, enqueue, events, move, new_job

MIB = 1 << 20


def test_messages_and_event_details_are_cut_with_a_marker_and_stored(store: Store) -> None:
    job = new_job(store)
    moved = move(store, job.id, JS.JOB_STATE_PROFILING, message="x" * MIB, attributes={"why": "y" * MIB})
    assert len(moved.message) == MAX_MESSAGE_CHARS and moved.message.endswith("characters cut]")
    appended = store.as_(store.a).append_job_event(store_pb2.AppendJobEventRequest(
        event=job_pb2.JobEvent(job_id=job.id, type="NOTE", message="z" * (MAX_MESSAGE_CHARS + 1))))
    assert len(appended.message) == MAX_MESSAGE_CHARS
    stored = events(store, job.id)
    assert [len(e.message) for e in stored[1:]] == [MAX_MESSAGE_CHARS, MAX_MESSAGE_CHARS]
    assert len(stored[1].attributes["why"]) == 1024
    short = move(store, job.id, JS.JOB_STATE_PLANNING, message="fits")
    assert short.message == "fits"


def test_too_many_attributes_and_a_payload_over_its_size_are_refused(store: Store) -> None:
    job = new_job(store)
    with pytest.raises(InvalidArgument) as err:
        move(store, job.id, JS.JOB_STATE_PROFILING, attributes={f"k{i}": "v" for i in range(65)})
    assert err.value.field == "attributes"
    before = store.count("queued_requests")
    with pytest.raises(InvalidArgument) as err:
        enqueue(store, '{"text": "' + "x" * MAX_PAYLOAD_BYTES + '"}')
    assert err.value.field == "payload_json" and "KiB" in err.value.fix
    assert store.count("queued_requests") == before


def custom(**kwargs) -> model_pb2.ModelSpec:
    spec = model_pb2.ModelSpec(name="kw", family=model_pb2.MODEL_FAMILY_CUSTOM,
                               custom=model_pb2.CustomModel(factory="mypkg.models:build", cut_points=["a"]))
    spec.custom.kwargs.update(kwargs)
    return spec


@pytest.mark.parametrize(("spec", "field"), [
    (job_pb2.JobSpec(name="n" * (MAX_TEXT_BYTES + 1)), "spec.name"),
    (job_pb2.JobSpec(init_from="/" + "d" * MAX_TEXT_BYTES), "spec.init_from"),
    (job_pb2.JobSpec(model=custom(blob="b" * (64 << 10))), "spec.model.custom.kwargs"),
], ids=["name", "path", "kwargs"])
def test_request_text_past_its_size_is_refused_naming_the_field(spec: job_pb2.JobSpec, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_job_spec(spec)
    assert err.value.field == field and "docs/limits.md" in err.value.fix


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    plane = start_plane(make_settings(tmp_path_factory.mktemp("text-limits")), send=lambda request_id: None)
    yield plane
    plane.stop()


def test_echo_of_10_mib_is_refused_and_nothing_is_queued(plane) -> None:
    with plane.client() as client:
        before = client.sql("SELECT count(*) FROM queued_requests").rows[0][0]
        with pytest.raises((CallFailed, grpc.RpcError)) as err:
            client.planner.Echo(services_pb2.EchoRequest(text="e" * (10 * MIB)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text" in err.value.details()
        assert client.sql("SELECT count(*) FROM queued_requests").rows[0][0] == before
        queued = client.planner.Echo(services_pb2.EchoRequest(text="e" * MAX_TEXT_BYTES))  # the limit itself fits
        assert queued.id and client.sql("SELECT count(*) FROM queued_requests").rows[0][0] == before + 1


BOMBS = {
    "laughs": "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(9)),
    "deep": "name: " + "[" * 5000 + "]" * 5000 + "\n",
    "broken": "name: gpt\n  family: [unclosed\n",
}


@pytest.mark.parametrize("kind", BOMBS)
def test_a_yaml_bomb_or_bad_yaml_is_one_line_from_every_command(plane, monkeypatch, capsys, tmp_path, kind) -> None:
    from tests.harness import ROOT, in_process_cli

    monkeypatch.chdir(ROOT)
    ballast = in_process_cli(plane.settings, monkeypatch, capsys)
    bomb = tmp_path / f"{kind}.yaml"
    bomb.write_text(BOMBS[kind])
    for argv in (("submit", str(bomb)), ("profile", str(bomb)), ("inspect", str(bomb)),
                 ("plan", str(bomb), "--fleet", "examples/fleet-8xTITAN.yaml"),
                 ("plan", "examples/gpt-tiny.yaml", "--fleet", str(bomb))):
        code, out, err = ballast(*argv)
        text = out + err
        assert code != 0 and "Traceback" not in text, (argv, text[-2000:])
        assert len(text.strip().splitlines()) <= 3 and bomb.name in text, (argv, text)
