"""The SDK's typed calls (ballast.Client, ballast/sdk.py, ballast/errors.py): arguments refused before anything is
sent with the parameter and the fix, server refusals as CallFailed with the server's field and fix, and the calls
against real store and planner servers (no worker: a job stays SUBMITTED)."""

from __future__ import annotations

import os

import grpc
import pytest
from google.protobuf import struct_pb2

from ballast import Client, sdk
from ballast.errors import ERROR_FIELD, ERROR_FIX, ERROR_MESSAGE, CallFailed, ClientError, InvalidInput
from ballast.v1 import job_pb2, plan_pb2, store_pb2
from tests.harness import ROOT, make_settings, start_plane

TINY = ROOT / "examples" / "gpt-tiny.yaml"
S = job_pb2.JobState


def test_the_package_exports_the_client() -> None:
    import ballast.client

    assert Client is ballast.client.Client


def test_a_job_spec_from_a_spec_file_and_named_options() -> None:
    spec = sdk.job_spec(TINY, batch=4, iterations=3, memory="1GiB", engine="Varuna", schedule="1f1b", priority="high",
                        min_devices=1, max_devices=2, checkpoint_every=5)
    assert spec.name == "gpt-tiny" and spec.model.transformer.num_layers == 4
    assert (spec.global_batch_size, spec.iterations, spec.memory_budget_bytes) == (4, 3, 1 << 30)
    assert spec.engine == plan_pb2.PLAN_ENGINE_VARUNA and spec.schedule == plan_pb2.SCHEDULE_1F1B
    assert (spec.priority_class, spec.min_devices, spec.max_devices, spec.checkpoint_every) == ("high", 1, 2, 5)
    assert not spec.HasField("fleet")


@pytest.mark.parametrize("options, field, words", [
    ({"min_devices": 2}, "max_devices", "min_devices=2 needs max_devices too"),
    ({"max_devices": 3}, "min_devices", "max_devices=3 needs min_devices too"),
    ({"min_devices": 4, "max_devices": 2}, "min_devices", "e.g. min_devices=2 max_devices=4"),
    ({"elastic": True}, "min_devices", "an elastic job is resized within its device range"),
    ({"batch": 0}, "batch", "whole number >= 1"),
    ({"iterations": 2.5}, "iterations", "whole number >= 1"),
    ({"engine": "zero"}, "engine", "use one of galvatron, harmony, patrickstar, varuna"),
    ({"schedule": "pipedream"}, "schedule", "use one of 1f1b, gpipe, varuna"),
    ({"memory": "lots"}, "memory", "16GiB"),
    ({"memory": -1}, "memory", "must not be negative"),
])
def test_bad_options_name_the_parameter_and_the_fix(options, field, words) -> None:
    with pytest.raises(InvalidInput) as caught:
        sdk.job_spec(TINY, **options)
    assert caught.value.field == field and words in str(caught.value) and isinstance(caught.value, ValueError)


def test_a_spec_file_that_cannot_be_read_names_the_model(tmp_path) -> None:
    with pytest.raises(InvalidInput, match="cannot read") as missing:
        sdk.model_spec(tmp_path / "nope.yaml")
    assert missing.value.field == "model" and "examples/gpt-tiny.yaml" in missing.value.fix
    (tmp_path / "bad.yaml").write_text("name: x\nlayers: 3\n")
    with pytest.raises(InvalidInput, match="bad.yaml: unknown field 'layers'") as unknown:
        sdk.model_spec(tmp_path / "bad.yaml")
    assert unknown.value.field == "layers" and "known: name, family" in unknown.value.fix
    (tmp_path / "typo.yaml").write_text("name: x\nfamily: MODEL_FAMILY_GPT\ntransformer:\n  num_head: 4\n")
    with pytest.raises(InvalidInput, match="unknown field 'num_head'") as typo:
        sdk.model_spec(tmp_path / "typo.yaml")
    assert typo.value.field == "transformer.num_head" and typo.value.fix.startswith("did you mean 'num_heads'?")
    (tmp_path / "enum.yaml").write_text("family: MODEL_FAMILY_LLAMA\n")
    with pytest.raises(InvalidInput, match="'MODEL_FAMILY_LLAMA' is not a ModelFamily") as enum:
        sdk.model_spec(tmp_path / "enum.yaml")
    assert enum.value.field == "family" and "MODEL_FAMILY_HF" in enum.value.fix
    with pytest.raises(InvalidInput):
        sdk.model_spec(42)  # type: ignore[arg-type]


def test_states_to_follow_until() -> None:
    assert sdk.job_state("Running") == sdk.job_state("JOB_STATE_RUNNING") == S.JOB_STATE_RUNNING
    assert sdk.job_state(S.JOB_STATE_QUEUED) == S.JOB_STATE_QUEUED and sdk.job_state(None) is None
    with pytest.raises(InvalidInput, match="use one of submitted") as caught:
        sdk.job_state("done")
    assert caught.value.field == "until"
    assert sdk.reached(S.JOB_STATE_RUNNING, S.JOB_STATE_SCHEDULED)
    assert not sdk.reached(S.JOB_STATE_PLANNING, S.JOB_STATE_SCHEDULED)
    assert not sdk.reached(S.JOB_STATE_RUNNING, None) and sdk.reached(S.JOB_STATE_FAILED, S.JOB_STATE_RUNNING)


def test_profile_kinds_for_a_fleet() -> None:
    assert sdk.profile_kind("auto", "cpu") == "measured" and sdk.profile_kind("auto", "h100") == "analytical"
    spec = sdk.model_spec(TINY)
    analytical = sdk.plan_profile_request(spec, [1, 2], "analytical", "h100", 0)
    assert analytical.analytical and analytical.device_kind == "h100"
    assert list(analytical.options.micro_batch_sizes) == [1, 2]
    assert sdk.plan_profile_request(spec, [1], "projected", "h100", 0).project_to == "h100"
    with pytest.raises(InvalidInput, match="this host measures cpu") as caught:
        sdk.plan_profile_request(spec, [1], "measured", "h100", 0)
    assert caught.value.field == "profile"
    with pytest.raises(InvalidInput, match="use one of auto"):
        sdk.profile_kind("guessed", "cpu")


class _Refused(grpc.RpcError):
    def __init__(self, trailing: tuple = ()):
        self.trailing = trailing

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self) -> str:
        return "spec.iterations: must be positive (set iterations > 0)"

    def trailing_metadata(self) -> tuple:
        return self.trailing


def test_a_refused_call_keeps_the_servers_field_and_fix() -> None:
    failed = CallFailed.of("JobService.Submit", _Refused(((ERROR_MESSAGE, b"must be positive"),
                                                          (ERROR_FIELD, b"spec.iterations"),
                                                          (ERROR_FIX, b"set iterations > 0"))))
    assert (failed.status, failed.field, failed.fix, failed.message) == (
        "INVALID_ARGUMENT", "spec.iterations", "set iterations > 0", "must be positive")
    assert str(failed) == "JobService.Submit INVALID_ARGUMENT: spec.iterations: must be positive (set iterations > 0)"
    assert isinstance(failed, grpc.RpcError) and failed.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failed.details() == "spec.iterations: must be positive (set iterations > 0)"
    plain = CallFailed.of("JobService.Submit", _Refused())  # from another server: its details as they are
    assert plain.field is None and plain.message == "spec.iterations: must be positive (set iterations > 0)"


def test_sql_rows_come_back_as_plain_values() -> None:
    row = struct_pb2.ListValue()
    row.extend([3.0, 0.5, "job-1", None])
    result = sdk.SqlResult.of(store_pb2.QueryResponse(columns=["n", "s", "job", "loss"], rows=[row]))
    assert result.rows == [[3, 0.5, "job-1", None]] and result.dicts() == [{"n": 3, "s": 0.5, "job": "job-1",
                                                                              "loss": None}]


def test_a_client_without_an_address_says_which_to_give() -> None:
    with Client(store="127.0.0.1:1") as client, pytest.raises(ClientError, match="no planner address") as caught:
        client.queue()
    assert caught.value.field == "planner" and "Client.from_env()" in caught.value.fix


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    plane = start_plane(make_settings(tmp_path_factory.mktemp("sdk")), ("store", "planner"),
                        send=lambda request_id: None)
    try:
        yield plane
    finally:
        plane.stop()


def test_submit_watch_sql_and_refusals_against_real_servers(plane, monkeypatch) -> None:
    for key in [k for k in os.environ if k.startswith("BALLAST_")]:  # the plane's settings, not the shell's
        monkeypatch.delenv(key)
    with Client.from_env(**{name: getattr(plane.settings, name) for name in (
            "data_dir", "store_port", "planner_port", "profiler_port")}) as client:
        job = client.submit(TINY, batch=4, iterations=3, name="sdk-unit")
        assert job.state == S.JOB_STATE_SUBMITTED and job.spec.name == "sdk-unit"
        events = list(client.watch(job.id, until="submitted"))  # no worker: it stays SUBMITTED
        assert [e.type for e in events] == ["SUBMITTED"] and client.job(job.id).id == job.id
        assert client.queue() == [] and client.fleet_view().devices == []
        result = client.sql(f"SELECT id, state FROM jobs WHERE id = '{job.id}'")
        assert result.columns == ["id", "state"] and result.rows == [[job.id, "JOB_STATE_SUBMITTED"]]
        assert client.cancel(job.id, reason="test").state == S.JOB_STATE_CANCELLED
        assert client.wait(job.id).state == S.JOB_STATE_CANCELLED
        with pytest.raises(CallFailed) as missing:
            client.explain("pln-nope")
        assert missing.value.status == "NOT_FOUND" and missing.value.call == "PlannerService.GetPlan"
        with pytest.raises(CallFailed) as refused:
            client.submit(TINY, batch=4, iterations=3, micro_batches=3)  # 3 does not split 4
        assert refused.value.status == "INVALID_ARGUMENT" and refused.value.field == "spec.micro_batches"
        assert "divisor" in refused.value.fix
        with pytest.raises(CallFailed) as read_only:
            client.sql("DELETE FROM jobs")
        assert read_only.value.status == "PERMISSION_DENIED"
        with pytest.raises(InvalidInput):
            client.sql("  ")
        with pytest.raises(InvalidInput, match="Fleet"):
            client.plan(TINY, "examples/fleet-8xTITAN.yaml")  # type: ignore[arg-type]


def test_init_from_a_relative_directory_is_sent_absolute(tmp_path, monkeypatch) -> None:
    """The README's `--init-from data/gpt-tiny-notes`: the services read the weights at the path they get."""
    from ballast.sdk import weights_source

    (tmp_path / "data" / "exported").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert weights_source("data/exported") == str(tmp_path / "data" / "exported")
    assert weights_source("job-abc:20") == "job-abc:20" and weights_source("") == ""
    assert weights_source("nowhere/else") == "nowhere/else"  # left for the service to refuse, naming it
