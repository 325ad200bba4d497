"""ProfilerService over real gRPC: measure in a worker process, store, cache, project, refuse bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from ballast.v1 import common_pb2, model_pb2, services_pb2, store_pb2
from services.profiler.runner import Runner
from services.runtime.errors import ERROR_FIELD, Unavailable
from tests.harness import ROOT, make_settings, settings_env, start_plane

pytestmark = pytest.mark.slow


def tiny_gpt(name: str = "gpt-prof") -> model_pb2.ModelSpec:
    return model_pb2.ModelSpec(
        name=name, family=model_pb2.MODEL_FAMILY_GPT,
        transformer=model_pb2.TransformerConfig(num_layers=2, hidden_size=32, num_heads=2, vocab_size=64,
                                                seq_length=16, tie_embeddings=True))


def request(spec: model_pb2.ModelSpec, **kw) -> services_pb2.ProfileRequest:
    options = services_pb2.ProfileOptions(micro_batch_sizes=[1, 2], repeats=5, skip_memory_trace=False)
    return services_pb2.ProfileRequest(model=spec, options=options, **kw)


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    plane = start_plane(make_settings(tmp_path_factory.mktemp("prof")), services=("store", "profiler"))
    yield plane
    plane.stop()


def test_profile_streams_progress_stores_rows_and_then_hits_the_cache(plane) -> None:
    with plane.client() as client:
        updates = list(client.profiler.ProfileStream(request(tiny_gpt()), timeout=300))
        final = updates[-1]
        assert final.phase == "done" and not final.cached and final.fraction == 1.0
        assert any(u.phase == "measure" for u in updates)
        profile = final.profile
        assert profile.id and profile.device.kind == "cpu" and profile.intra_op_threads == 1
        assert [layer.name for layer in profile.layers] == ["embed", "block.0", "block.1", "head"]
        assert list(profile.measured_micro_batch_sizes) == [1, 2]
        assert profile.layers[2].measured_as == 1  # identical blocks are measured once
        assert profile.software.startswith("torch ")

        stored = client.profiler.GetProfile(store_pb2.GetRequest(id=profile.id))
        assert stored == profile
        rows = client.store.Query(store_pb2.QueryRequest(sql=(
            "SELECT l.name, s.micro_batch_size, s.forward_s > 0 FROM profile_layers l "
            "JOIN profile_layer_samples s ON s.profile_id = l.profile_id AND s.layer_index = l.layer_index "
            f"WHERE l.profile_id = '{profile.id}' ORDER BY l.layer_index, s.micro_batch_size"))).rows
        assert len(rows) == 8 and all(row[2] for row in rows)

        again = list(client.profiler.ProfileStream(request(tiny_gpt()), timeout=60))
        assert again[-1].cached and again[-1].profile.id == profile.id and len(again) == 1

        # Asking for calibrated links (a job on several devices of one machine) measures again: the cached
        # profile has none. The calibrated one then serves both kinds of request.
        calibrating = request(tiny_gpt())
        calibrating.options.calibrate = True
        calibrating.options.calibrate_group_sizes.append(2)
        measured = list(client.profiler.ProfileStream(calibrating, timeout=300))[-1]
        assert not measured.cached and measured.profile.comm.fits and measured.profile.comm.colocated_slowdown >= 1
        for ask in (calibrating, request(tiny_gpt())):
            hit = list(client.profiler.ProfileStream(ask, timeout=60))[-1]
            assert hit.cached and hit.profile.id == measured.profile.id


def test_projection_is_stored_and_marked(plane) -> None:
    with plane.client() as client:
        final = list(client.profiler.ProfileStream(request(tiny_gpt(), project_to="A100-80GB"), timeout=300))[-1]
        projected = final.profile
        assert projected.projected and projected.source_profile_id
        assert projected.device.kind == "nvidia-a100-80gb"
        source = client.profiler.GetProfile(store_pb2.GetRequest(id=projected.source_profile_id))
        assert not source.projected and source.device.kind == "cpu"
        kinds = {d.kind for d in client.profiler.ListDeviceKinds(services_pb2.ListDeviceKindsRequest()).devices}
        assert {"cpu", "nvidia-h100-sxm-80gb", "nvidia-a100-40gb"} <= kinds


@pytest.mark.parametrize(
    "mutate, code, field",
    [
        (lambda r: setattr(r.model.transformer, "num_heads", 3), grpc.StatusCode.INVALID_ARGUMENT, "num_heads"),
        (lambda r: setattr(r.model.transformer, "num_layers", 0), grpc.StatusCode.INVALID_ARGUMENT, "num_layers"),
        (lambda r: setattr(r, "device_kind", "tpu-v9"), grpc.StatusCode.INVALID_ARGUMENT, "device"),
        (lambda r: setattr(r, "device_kind", "H100"), grpc.StatusCode.FAILED_PRECONDITION, "project_to"),
        (lambda r: setattr(r, "project_to", "abacus"), grpc.StatusCode.INVALID_ARGUMENT, "device"),
        (lambda r: setattr(r, "time_budget_s", -5.0), grpc.StatusCode.INVALID_ARGUMENT, "time_budget_s"),
        (lambda r: setattr(r, "time_budget_s", float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "time_budget_s"),
        # refused inside the profiling worker process: its answer still carries the field (fuzz finding)
        # (a model of its own: an identical one's cached profile would be served before the worker runs)
        (lambda r: (r.options.micro_batch_sizes.append(0), setattr(r.model.transformer, "vocab_size", 96)),
         grpc.StatusCode.INVALID_ARGUMENT, "options.micro_batch_sizes"),
    ],
)
def test_bad_input_names_the_field_and_stores_nothing(plane, mutate, code, field) -> None:
    bad = request(tiny_gpt(f"bad-{field}"))
    mutate(bad)
    with plane.client() as client:
        before = client.store.Query(store_pb2.QueryRequest(sql="SELECT count(*) FROM profiles")).rows[0][0]
        with pytest.raises(grpc.RpcError) as info:
            list(client.profiler.ProfileStream(bad, timeout=120))
        assert info.value.code() == code
        assert field in info.value.details()
        assert dict(info.value.trailing_metadata()).get(ERROR_FIELD)  # the field, for a client to show
        after = client.store.Query(store_pb2.QueryRequest(sql="SELECT count(*) FROM profiles")).rows[0][0]
        assert after == before


def test_analytical_profile_for_any_catalog_device_is_stored_once_and_measures_nothing(plane) -> None:
    ask = services_pb2.ProfileRequest(model=tiny_gpt("gpt-analytical"), analytical=True, device_kind="A100-80GB",
                                      options=services_pb2.ProfileOptions(micro_batch_sizes=[1, 2, 4]))
    with plane.client() as client:
        updates = list(client.profiler.ProfileStream(ask, timeout=60))
        assert len(updates) == 1 and not updates[0].cached  # no measuring phases: nothing ran on this host
        profile = updates[0].profile
        assert profile.id and profile.projected and not profile.source_profile_id
        assert profile.device.kind == "nvidia-a100-80gb" and profile.software.startswith("analytical roofline")
        assert [s.micro_batch_size for s in profile.layers[0].samples] == [1, 2, 4]
        assert not any(s.measured for layer in profile.layers for s in layer.samples)
        again = client.profiler.Profile(ask, timeout=60)
        assert again == profile  # the same model, device, precision, formula and sizes: reused
        for mutate, field in [(lambda r: setattr(r, "device_kind", ""), "device_kind"),
                              (lambda r: setattr(r, "project_to", "H100"), "project_to"),
                              (lambda r: setattr(r, "device_kind", "abacus"), "device")]:
            bad = services_pb2.ProfileRequest()
            bad.CopyFrom(ask)
            mutate(bad)
            with pytest.raises(grpc.RpcError) as info:
                client.profiler.Profile(bad, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()


def test_a_worker_that_dies_is_reported_and_nothing_is_stored(plane) -> None:
    from services.runtime.store_client import remote_stores

    as_caller, _ = remote_stores(plane.settings)
    crash = (sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    runner = Runner(as_caller, worker_command=crash)
    spec = tiny_gpt("crashes")
    with plane.client() as client:
        before = client.store.Query(store_pb2.QueryRequest(sql="SELECT count(*) FROM profiles")).rows[0][0]
    with pytest.raises(Unavailable, match="worker died"):
        runner.profile(request(spec, refresh=True, dtype=common_pb2.DTYPE_FP32))
    with plane.client() as client:
        after = client.store.Query(store_pb2.QueryRequest(sql="SELECT count(*) FROM profiles")).rows[0][0]
    assert after == before


def test_calibrate_rpc_measures_real_gloo_collectives(plane) -> None:
    with plane.client() as client:
        comm = client.profiler.Calibrate(
            services_pb2.CalibrateRequest(group_sizes=[2], sizes_bytes=[64 * 1024, 256 * 1024, 1024 * 1024]),
            timeout=180)
        for bad, field in (({"group_sizes": [1]}, "group_sizes"), ({"group_sizes": [2**31]}, "group_sizes"),
                           ({"backend": "../../x"}, "backend"), ({"sizes_bytes": [2**40]}, "sizes_bytes")):
            with pytest.raises(grpc.RpcError) as info:  # refused before any rank starts
                client.profiler.Calibrate(services_pb2.CalibrateRequest(**bad), timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()
    assert {s.collective for s in comm.collectives} >= {"allreduce", "allgather"}
    assert all(s.seconds > 0 and s.group_size == 2 for s in comm.collectives)
    assert comm.links and all(s.seconds > 0 for s in comm.links)
    assert comm.overlap_slowdown >= 1.0
    fits = {(f.collective, f.group_size): f for f in comm.fits}
    assert ("allreduce", 2) in fits and fits["allreduce", 2].r2 <= 1.0  # a fit with its goodness of fit


def test_the_worker_runs_with_the_steady_allocator(plane) -> None:
    from services.runtime.allocator import STEADY_ALLOCATOR
    from services.runtime.errors import InvalidArgument
    from services.runtime.store_client import remote_stores

    as_caller, _ = remote_stores(plane.settings)
    script = ("import json, os, sys; sys.stdin.read(); print(json.dumps({'error': {'code': 'INVALID_ARGUMENT', "
              "'message': os.environ.get('MALLOC_MMAP_MAX_', 'unset')}})); sys.exit(1)")
    report_env = (sys.executable, "-c", script)
    runner = Runner(as_caller, worker_command=report_env)
    with pytest.raises(InvalidArgument) as info:
        runner.profile(request(tiny_gpt("env-check"), refresh=True))
    assert str(info.value) == STEADY_ALLOCATOR["MALLOC_MMAP_MAX_"]


def test_cli_prints_progress_lines_as_the_service_streams_them(plane, tmp_path: Path) -> None:
    """`ballast profile` with stderr not a terminal: one plain line per update (fraction, elapsed, ETA), arriving
    while the profile runs, then the table on stdout. The default sweep, bounded by a small budget."""
    spec = tmp_path / "gpt-cli.yaml"
    spec.write_text("name: gpt-cli\nfamily: MODEL_FAMILY_GPT\ntransformer: {num_layers: 2, hidden_size: 32, "
                    "num_heads: 2, vocab_size: 64, seq_length: 16}\n")
    env = {**settings_env(plane.settings), "COLUMNS": "200"}
    cli = subprocess.Popen([sys.executable, "-m", "ballast", "profile", str(spec), "--device", "cpu",
                            "--time-budget-s", "3", "--data-dir", str(plane.settings.data_dir)],
                           env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = cli.stderr.readline()
    running = cli.poll() is None  # the first line came while the worker was still measuring, not at the end
    rest, err = cli.communicate(timeout=300)
    lines = [first, *err.splitlines()]
    assert cli.returncode == 0, "".join(lines) + rest
    assert running and first.startswith("profile   0% queued")
    progress = [line for line in lines if line.startswith("profile ")]
    assert len(progress) > 5 and all(" elapsed " in line and " eta " in line for line in progress)
    assert any(" measure layer " in line and " m=" in line for line in progress)
    swept = [line for line in progress if " swept " in line]
    assert len(swept) == 1 and "measured micro-batch sizes [1" in swept[0]
    assert progress[-1].startswith("profile 100% done") and "profile prf-" in progress[-1]
    assert "head" in rest and "measured sizes [1" in rest
