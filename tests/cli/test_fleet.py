"""The shared-fleet CLI: submit's device flags refused before any RPC, `queue` / `fleet` / `policy` formatting
from constructed protos, the events `watch` prints, and the planner's start-up policy file."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from ballast.cli import fleet as cli_fleet
from ballast.cli.follow import ORDER, STATES, S, event_line
from ballast.cli.jobs import job_spec
from ballast.cli.main import main, parse_args
from ballast.v1 import fleet_pb2, job_pb2, services_pb2, store_pb2
from services.planner.policy_file import apply_policy_file, content
from services.runtime.errors import InvalidArgument, PermissionDenied
from services.specs.policy import default_policy, load_policy_file

NOW = 1_800_000_000.0
SUBMIT = ["submit", "examples/gpt-tiny.yaml"]
POLICY = """\
default_priority_class: normal
priority_classes:
  - {name: low, priority: 0}
  - {name: normal, priority: 10}
  - {name: high, priority: 100, preempts: true}
tenants:
  - {tenant: team-a, device_quota: 4, weight: 1, max_priority_class: normal}
  - {tenant: team-b, weight: 2.5, max_priority_class: high}
fair_share_half_life_s: 1800
"""


def ts(seconds: float) -> Timestamp:
    out = Timestamp()
    out.FromMicroseconds(int(seconds * 1e6))
    return out


# --- submit: device flags ------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--min-devices", "--max-devices"])
@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_device_counts_below_one_or_not_whole_are_refused_naming_the_flag(flag, value, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args([*SUBMIT, f"{flag}={value}", "--min-devices=1" if flag == "--max-devices" else "--max-devices=4"])
    assert exit_.value.code == 2
    stderr = capsys.readouterr().err
    assert f"argument {flag}: must be a whole number of devices >= 1 (got {value!r}), e.g. {flag} 2" in stderr


def test_a_negative_count_written_apart_is_a_value_not_an_option(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args([*SUBMIT, "--min-devices", "-1", "--max-devices", "2"])
    assert "argument --min-devices: must be a whole number of devices >= 1 (got '-1')" in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [
    (["--min-devices", "4", "--max-devices", "2"],
     "--min-devices 4 is above --max-devices 2: the range must have --min-devices <= --max-devices, "
     "e.g. --min-devices 2 --max-devices 4"),
    (["--min-devices", "3"], "--min-devices 3 needs --max-devices too: give both (e.g. --min-devices 3 "
                             "--max-devices 3 for exactly 3)"),
    (["--max-devices", "8"], "--max-devices 8 needs --min-devices too: give both (e.g. --min-devices 1 "
                             "--max-devices 8 for any count up to 8)"),
    (["--elastic"], "--elastic needs the range the job may be resized within: give --min-devices and "
                    "--max-devices too"),
])
def test_a_bad_device_range_stops_main_before_any_rpc(flags, words, capsys, tmp_path) -> None:
    # main() would need a planner for anything past parsing; there is none at this data dir
    with pytest.raises(SystemExit) as exit_:
        main([*SUBMIT, "--data-dir", str(tmp_path), *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: ballast submit" in err and words in err


def test_submit_flags_fill_the_job_spec() -> None:
    spec = job_spec(parse_args([*SUBMIT, "--priority", "high", "--min-devices", "2", "--max-devices", "4"]))
    assert (spec.priority_class, spec.min_devices, spec.max_devices) == ("high", 2, 4)
    plain = job_spec(parse_args(SUBMIT))
    assert (plain.priority_class, plain.min_devices, plain.max_devices) == ("", 0, 0)
    exact = job_spec(parse_args([*SUBMIT, "--min-devices", "3", "--max-devices", "3"]))
    assert (exact.min_devices, exact.max_devices, exact.elastic) == (3, 3, False)
    elastic = job_spec(parse_args([*SUBMIT, "--elastic", "--min-devices", "1", "--max-devices", "4"]))
    assert (elastic.min_devices, elastic.max_devices, elastic.elastic) == (1, 4, True)
    assert job_spec(parse_args([*SUBMIT, "--raw-metrics"])).raw_metrics and not plain.raw_metrics


def test_policy_and_fleet_commands_parse() -> None:
    assert parse_args(["policy", "show", "--version", "3", "--data-dir", "/d"]).version == 3
    args = parse_args(["policy", "--data-dir", "/d", "set", "p.yaml", "--expected-version", "2"])
    assert (args.action, args.file, args.expected_version, str(args.data_dir)) == ("set", Path("p.yaml"), 2, "/d")
    assert parse_args(["queue", "--json"]).json and not parse_args(["fleet"]).json
    assert parse_args(["up", "--policy", "p.yaml"]).policy == Path("p.yaml")
    with pytest.raises(SystemExit):
        parse_args(["policy"])


def test_policy_set_refuses_a_bad_file_before_any_rpc(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("priority_classes: [{name: x, priorty: 1}]\n")
    assert main(["policy", "set", str(bad), "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "policy" in err and "priorty" in err


def test_serve_policy_is_for_the_planner_only(tmp_path, capsys) -> None:
    assert main(["serve", "store", "--policy", "p.yaml", "--data-dir", str(tmp_path)]) == 2
    assert "--policy is the planner's option" in capsys.readouterr().err


def test_the_policy_flag_reaches_the_settings(tmp_path) -> None:
    from ballast.cli.main import _settings

    (tmp_path / "p.yaml").write_text(POLICY)
    settings = _settings(parse_args(["up", "--data-dir", str(tmp_path), "--policy", str(tmp_path / "p.yaml")]))
    assert settings.fleet_policy == str(tmp_path / "p.yaml")


# --- queue and fleet formatting ------------------------------------------------------------------------------
def entries() -> list[services_pb2.QueueEntry]:
    W = services_pb2
    return [
        W.QueueEntry(position=1, job_id="job-1", tenant="team-a", tenant_id="t-a", priority_class="high",
                     priority=100, devices=4, device_kind="h100", reason=W.WAIT_REASON_UNSPECIFIED,
                     detail="starting now", predicted_start_s=0.0, predicted_duration_s=600,
                     submitted_at=ts(NOW - 42)),
        W.QueueEntry(position=2, tenant="team-b", tenant_id="t-b", priority_class="normal", priority=10,
                     devices=2, device_kind="h100", reason=W.WAIT_REASON_DEVICES_BUSY, predicted_start_s=42.4,
                     predicted_duration_s=120, submitted_at=ts(NOW - 3 * 3600), preemptions=2),
        W.QueueEntry(position=3, job_id="job-3", tenant="team-a", tenant_id="t-a", priority_class="low",
                     devices=1, device_kind="cpu", reason=W.WAIT_REASON_NO_EXECUTOR,
                     detail="no executor offers cpu", predicted_start_s=-1, submitted_at=ts(NOW - 90)),
    ]


def test_queue_rows_say_why_and_when_in_words() -> None:
    assert cli_fleet.queue_rows(entries(), NOW) == [
        ("1", "job-1", "team-a", "high", "4 × h100", "starting", "now", "42 s", "-"),
        ("2", "—", "team-b", "normal", "2 × h100", "devices busy", "in 42 s", "3.0 h", "2"),
        ("3", "job-3", "team-a", "low", "1 × cpu", "no executor", "unknown", "2 min", "-"),
    ]


def test_every_wait_reason_has_short_words() -> None:
    assert set(cli_fleet.REASONS) == set(services_pb2.WaitReason.values())
    assert {cli_fleet.reason_words(r) for r in services_pb2.WaitReason.values()} == {
        "starting", "devices busy", "quota", "job ahead", "no executor", "preempted", "replanning", "calibrating"}


def test_queue_records_are_json_ready() -> None:
    import json

    records = cli_fleet.queue_records(entries(), NOW)
    json.dumps(records)
    assert records[1]["job_id"] is None and records[1]["detail"] is None and records[1]["preemptions"] == 2
    assert records[2]["predicted_start_s"] is None and records[2]["reason"] == "no executor"
    assert records[0]["waited_s"] == 42.0 and records[0]["predicted_start_s"] == 0.0


def test_queue_table_renders_every_row() -> None:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(cli_fleet.queue_table(entries(), NOW))
    text = console.export_text()
    for words in ("job-1", "devices busy", "in 42 s", "unknown", "—", *cli_fleet.QUEUE_COLUMNS):
        assert words in text, text


def devices() -> list[services_pb2.FleetDevice]:
    lease = fleet_pb2.DeviceLease(id="lse-1", job_id="job-1", tenant_id="t-a", started_at=ts(NOW - 720),
                                  device=fleet_pb2.DeviceRef(host_id="h-1", device_index=0))
    return [
        services_pb2.FleetDevice(device=fleet_pb2.DeviceRef(host_id="h-1", device_index=0), host_name="gpu-a",
                                 device_kind="h100", online=True, lease=lease, utilisation_last_hour=0.5),
        services_pb2.FleetDevice(device=fleet_pb2.DeviceRef(host_id="h-1", device_index=1), host_name="gpu-a",
                                 device_kind="h100", online=True, utilisation_last_hour=0.0),
        services_pb2.FleetDevice(device=fleet_pb2.DeviceRef(host_id="h-2", device_index=0), host_name="",
                                 device_kind="h100", online=False, utilisation_last_hour=1.0),
    ]


def test_fleet_rows_show_who_leases_what_since_when() -> None:
    assert cli_fleet.fleet_rows(devices(), NOW, {"t-a": "team-a"}) == [
        ("gpu-a", "0", "h100", "yes", "job-1 (team-a)", "12 min ago", "50 %"),
        ("gpu-a", "1", "h100", "yes", "-", "-", "0 %"),
        ("h-2", "0", "h100", "no", "-", "-", "100 %"),
    ]
    # without tenant names (a tenant may not list tenants) the id stands in
    assert cli_fleet.fleet_rows(devices()[:1], NOW)[0][4] == "job-1 (t-a)"
    records = cli_fleet.fleet_records(devices(), NOW, {"t-a": "team-a"})
    assert records[0]["lease"]["tenant"] == "team-a" and records[0]["lease"]["age_s"] == 720.0
    assert records[1]["lease"] is None and records[2]["online"] is False


@pytest.mark.parametrize("seconds, words", [(0, "0 s"), (59.4, "59 s"), (61, "1 min"), (5400, "1.5 h"),
                                            (3 * 86400, "3.0 d"), (-5, "0 s")])
def test_durations(seconds, words) -> None:
    assert cli_fleet.duration(seconds) == words


# --- policy YAML -------------------------------------------------------------------------------------------
def stored(policy: fleet_pb2.FleetPolicy, version: int = 4) -> fleet_pb2.FleetPolicy:
    out = fleet_pb2.FleetPolicy()
    out.CopyFrom(policy)
    out.version, out.created_by = version, "admin"
    out.created_at.CopyFrom(ts(NOW))
    return out


@pytest.mark.parametrize("make", [lambda p: load_policy_file(p), lambda p: default_policy()])
def test_policy_show_prints_what_policy_set_reads(make, tmp_path) -> None:
    source = tmp_path / "in.yaml"
    source.write_text(POLICY)
    policy = stored(make(source))
    text = cli_fleet.policy_yaml(policy)
    out = tmp_path / "out.yaml"
    out.write_text(text)
    assert content(load_policy_file(out)) == content(policy)
    assert text.startswith("# fleet policy version 4, stored by admin at ")
    assert "  - {name: high, priority: 100, preempts: true}" in text


def test_policy_yaml_of_the_file_in_the_docs(tmp_path) -> None:
    (tmp_path / "p.yaml").write_text(POLICY)
    text = cli_fleet.policy_yaml(load_policy_file(tmp_path / "p.yaml"))
    assert "  - {tenant: team-a, device_quota: 4, weight: 1.0, max_priority_class: normal}" in text
    assert "fair_share_half_life_s: 1800.0" in text
    assert "# max_preemptions_per_hour: 2 (the default)" in text
    assert text.startswith("# the built-in default policy")  # version 0: nothing stored yet


def test_policy_summary_is_one_line(tmp_path) -> None:
    (tmp_path / "p.yaml").write_text(POLICY)
    line = cli_fleet.policy_summary(stored(load_policy_file(tmp_path / "p.yaml")))
    assert "\n" not in line
    assert line == ("policy v4 by admin: classes high=100 (preempts), normal=10 (default), low=0; tenants "
                    "team-a (quota 4, weight 1, max normal), team-b (weight 2.5, max high); fair-share half-life "
                    "1800 s; at most 2 preemptions per job per hour")
    assert "built-in default" in cli_fleet.policy_summary(default_policy())


# --- following a job ---------------------------------------------------------------------------------------
def test_queued_sits_between_scheduled_and_running() -> None:
    assert ORDER.index(S.JOB_STATE_SCHEDULED) < ORDER.index(S.JOB_STATE_QUEUED) < ORDER.index(S.JOB_STATE_RUNNING)
    assert parse_args(["watch", "job-1", "--until", "queued"]).until == "queued"
    assert STATES["queued"] == S.JOB_STATE_QUEUED


@pytest.mark.parametrize("kind, state, message, attributes, shown", [
    ("QUEUED", S.JOB_STATE_QUEUED, "waiting: 4 h100 busy", {"reason": "devices_busy", "priority_class": "high"},
     "waiting: 4 h100 busy (priority class high)"),
    ("ADMITTED", S.JOB_STATE_QUEUED, "admitted on 4 device(s) after 42.0 s queued",
     {"devices": "4", "waited_s": "42.000", "priority_class": "normal"},
     "admitted on 4 device(s) after 42.0 s queued (priority class normal)"),
    ("PREEMPTING", S.JOB_STATE_RUNNING, "draining for job job-9 (priority class high): checkpoint at the next "
     "iteration boundary", {"for_job": "job-9", "priority_class": "high"},
     "draining for job job-9 (priority class high): checkpoint at the next iteration boundary"),
    ("PREEMPTED", S.JOB_STATE_QUEUED, "preempted by job job-9; resumes from iteration 7",
     {"for_job": "job-9", "checkpoint_iteration": "7"}, "preempted by job job-9; resumes from iteration 7"),
])
def test_fleet_events_print_with_their_class(kind, state, message, attributes, shown) -> None:
    from rich.console import Console

    event = job_pb2.JobEvent(seq=7, type=kind, state=state, message=message, attributes=attributes)
    console = Console(width=300, record=True)
    console.print(event_line(event))
    text = console.export_text().rstrip("\n")
    assert text == f"   7 {job_pb2.JobState.Name(state).removeprefix('JOB_STATE_'):<14} {kind:<16} {shown}"


# --- the planner's start-up policy file ----------------------------------------------------------------------
@pytest.mark.parametrize("store_backend", ["sqlite"], indirect=True)
def test_apply_policy_file_stores_only_a_change(store, tmp_path) -> None:
    admin = store.as_(store.admin)
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    assert apply_policy_file(admin, "") is None  # no file configured: nothing to do
    first = apply_policy_file(admin, path)
    assert first is not None and first.version == 1 and first.created_by == store.admin.tenant_name
    assert apply_policy_file(admin, path) is None  # a restart with the same file stores nothing
    assert admin.get_fleet_policy(store_pb2.GetFleetPolicyRequest()).version == 1
    path.write_text(POLICY.replace("weight: 2.5", "weight: 3"))
    assert apply_policy_file(admin, path).version == 2
    path.write_text(POLICY)
    assert apply_policy_file(admin, path).version == 3  # back to the first content: a new version again

    bad = tmp_path / "bad.yaml"
    bad.write_text(POLICY.replace("team-b", "nobody"))
    with pytest.raises(InvalidArgument) as exc:
        apply_policy_file(admin, bad)
    assert exc.value.field == "policy.tenants[1].tenant" and "unknown tenant 'nobody'" in str(exc.value)
    with pytest.raises(InvalidArgument, match="cannot read policy file"):
        apply_policy_file(admin, tmp_path / "missing.yaml")
    with pytest.raises(PermissionDenied):
        apply_policy_file(store.as_(store.a), _changed(tmp_path))  # only the platform admin stores policies
    assert admin.get_fleet_policy(store_pb2.GetFleetPolicyRequest()).version == 3


def _changed(tmp_path: Path) -> Path:
    path = tmp_path / "changed.yaml"
    path.write_text(POLICY.replace("fair_share_half_life_s: 1800", "fair_share_half_life_s: 900"))
    return path


def test_a_bad_policy_file_stops_the_planner_with_the_error(tmp_path) -> None:
    """`ballast serve planner --policy FILE` against a running store: a file naming an unknown tenant ends the
    planner (exit 2) with the field and the fix; a good one is stored once, however often the planner starts."""
    from services.planner.service import build_server
    from tests.harness import ROOT, make_settings, settings_env, start_plane

    settings = make_settings(tmp_path / "d", sweep_interval_s=60.0)
    plane = start_plane(settings, ("store",))
    try:
        with plane.client() as admin:
            admin.store.CreateTenant(store_pb2.CreateTenantRequest(name="team-a"))
            admin.store.CreateTenant(store_pb2.CreateTenantRequest(name="team-b"))
        bad = tmp_path / "bad.yaml"
        bad.write_text(POLICY.replace("team-b", "nobody"))
        started = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "ballast", "serve", "planner", "--policy", str(bad)],
                             env={**settings_env(settings), "COLUMNS": "300"}, cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 2, run.stdout + run.stderr
        assert ("error policy.tenants[1].tenant: unknown tenant 'nobody' (create the tenant first (ballast tenant "
                "create NAME), or remove the entry)") in run.stderr
        assert time.monotonic() - started < 60

        good = tmp_path / "good.yaml"
        good.write_text(POLICY)
        for _ in range(2):  # two planner starts with one file
            planner = build_server(replace(settings, fleet_policy=str(good)), address="127.0.0.1:0",
                                   send=lambda request_id: None, agent_address="127.0.0.1:0")
            planner.server.stop(0)
        with plane.client() as admin:
            current = admin.store.GetFleetPolicy(store_pb2.GetFleetPolicyRequest())
        assert current.version == 1 and current.tenants[1].weight == 2.5
    finally:
        plane.stop()


def test_the_queued_line_while_following() -> None:
    from types import SimpleNamespace

    import grpc

    from ballast.cli.follow import queue_line

    def client(reply):
        def list_queue(request, timeout=None):
            if isinstance(reply, Exception):
                raise reply
            return services_pb2.ListQueueResponse(entries=reply)
        return SimpleNamespace(fleet=SimpleNamespace(ListQueue=list_queue))

    assert queue_line(client(entries()), "job-3") == "queued: position 3 of 3, no executor, start unknown"
    assert queue_line(client(entries()), "job-1") == "queued: position 1 of 3, starting, starts now"
    assert queue_line(client(entries()[:1] + [services_pb2.QueueEntry(position=2, job_id="job-2",
                                                                      predicted_start_s=42)]), "job-2") == \
        "queued: position 2 of 2, starting, starts in 42 s"
    assert queue_line(client(entries()), "job-gone") == "queued"
    assert queue_line(client(grpc.RpcError()), "job-1") == "queued"


# --- degraded hosts ----------------------------------------------------------------------------------------
SLOW = "rank 1 computed 2.0x its peers' time over 10 iterations"


def degraded_host(host_id: str = "h-1", name: str = "gpu-a", age_s: float = 12) -> fleet_pb2.Host:
    return fleet_pb2.Host(id=host_id, name=name, degraded_reason=SLOW, degraded_at=ts(NOW - age_s))


def test_a_degraded_host_shows_in_the_online_column_and_a_footer() -> None:
    marked = {"h-1": degraded_host()}
    rows = cli_fleet.fleet_rows(devices(), NOW, {"t-a": "team-a"}, marked)
    assert [r[3] for r in rows] == ["degraded", "degraded", "no"]
    offline = {"h-2": degraded_host("h-2", "h-2")}
    assert [r[3] for r in cli_fleet.fleet_rows(devices(), NOW, None, offline)] == ["yes", "yes", "no (degraded)"]
    records = cli_fleet.fleet_records(devices(), NOW, None, marked)
    assert records[0]["degraded"]["reason"] == SLOW and records[0]["degraded"]["age_s"] == 12.0
    assert records[2]["degraded"] is None
    healthy = fleet_pb2.Host(id="h-2", name="h-2")
    assert cli_fleet.degraded_lines([degraded_host(), healthy], NOW) == [
        f"gpu-a degraded 12 s ago: {SLOW}; `ballast fleet clear gpu-a --reason ...` gives it back"]


def test_clear_resolves_a_host_by_name_or_id() -> None:
    hosts = [degraded_host(), fleet_pb2.Host(id="h-2", name="gpu-b")]
    assert cli_fleet.resolve_host(hosts, "gpu-b").id == "h-2"
    assert cli_fleet.resolve_host(hosts, "h-1").name == "gpu-a"
    assert cli_fleet.resolve_host(hosts, "gpu-c") == "no host 'gpu-c'; known hosts: gpu-a (h-1), gpu-b (h-2)"
    assert cli_fleet.resolve_host([], "x") == "no host 'x'; known hosts: none registered yet"


def test_fleet_clear_parses_and_needs_a_reason(capsys) -> None:
    args = parse_args(["fleet", "--data-dir", "/d", "clear", "vm-1", "--reason", "replaced the GPU"])
    assert (args.action, args.host, args.reason, str(args.data_dir)) == ("clear", "vm-1", "replaced the GPU", "/d")
    assert parse_args(["fleet", "clear", "vm-1", "--reason", "x", "--data-dir", "/e"]).data_dir == Path("/e")
    assert parse_args(["fleet"]).action is None
    with pytest.raises(SystemExit):
        parse_args(["fleet", "clear", "vm-1"])
    assert "--reason" in capsys.readouterr().err


def test_fleet_shows_and_clears_a_degraded_host_on_a_running_plane(tmp_path, monkeypatch, capsys) -> None:
    """Store and planner serving: a host marked degraded through the store shows in `ballast fleet`, `ballast
    fleet clear` gives it back (by name), and an unknown name or a healthy host fail with exit 1."""
    import json

    from tests.harness import in_process_cli, make_settings, start_plane
    from tests.store_builders import host

    settings = make_settings(tmp_path / "d")
    plane = start_plane(settings, ("store", "planner"), send=lambda request_id: None)
    ballast = in_process_cli(settings, monkeypatch, capsys)

    try:
        store = plane.store()
        vm1 = store.register_host(store_pb2.RegisterHostRequest(host=host("vm-1", ["cpu"] * 2)))
        store.register_host(store_pb2.RegisterHostRequest(host=host("vm-2", ["cpu"])))
        store.mark_host_degraded(store_pb2.MarkHostDegradedRequest(id=vm1.id, reason=SLOW,
                                                                   evidence_json='{"rank": 1, "ratio": 2.0}'))
        code, out, _ = ballast("fleet")
        assert code == 0, out
        assert out.count("degraded") >= 2 and "2 on degraded hosts" in out
        # a second may pass on a loaded machine between marking it and asking
        assert re.search(rf"vm-1 degraded [01] s ago: {re.escape(SLOW)}; `ballast fleet clear vm-1 --reason \.\.\.` "
                         "gives it back", out), out
        code, _, err = ballast("fleet", "clear", "vm-9", "--reason", "probe passed")
        assert code == 1 and "no host 'vm-9'; known hosts: vm-1" in err and "vm-2" in err

        code, out, _ = ballast("fleet", "clear", "vm-1", "--reason", "probe passed")
        assert code == 0 and f"cleared vm-1 ({vm1.id})" in out and SLOW in out
        assert not store.get_host(store_pb2.GetRequest(id=vm1.id)).HasField("degraded_at")
        code, out, _ = ballast("fleet")
        assert code == 0 and "degraded" not in out
        code, _, err = ballast("fleet", "clear", vm1.id, "--reason", "again")
        assert code == 1 and "FAILED_PRECONDITION" in err and "not marked degraded" in err
        code, out, _ = ballast("sql", "--json", "SELECT d.reason, d.evidence, d.cleared_reason, t.name FROM "
                               "host_degradations d JOIN tenants t ON t.id = d.cleared_by")
        assert code == 0 and json.loads(out)["rows"] == [[SLOW, '{"rank": 1, "ratio": 2.0}', "probe passed",
                                                          "admin"]], out
    finally:
        plane.stop()
