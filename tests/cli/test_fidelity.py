"""`ballast fidelity` against a real store server on loopback (SQLite): runs seeded through the store's RPCs,
the table, the JSON, the PNG, tenancy, the error with nothing to report, and the user guide's SQL giving the same
numbers through `ballast sql`."""

from __future__ import annotations

import json
import struct

import pytest

from ballast.v1 import fleet_pb2, job_pb2, store_pb2
from services.planner.plans.make import CALIBRATED
from tests.harness import in_process_cli, make_settings, start_plane
from tests.store.test_guide_sql import guide_blocks
from tests.store_builders import gpt, host, job_spec, plan_msg

MiB = 1 << 20
NOTHING = "no measured iterations yet: run a job first, e.g. `ballast demo`"
# The admin's groups: gpt-tiny (team-a, two runs of 1 stage x 2 replicas on one machine of two 4- and 6-core
# agents; steady slowest ranks 0.12, 0.11, 0.13 -> 0.12 s and 0.10 s against 0.1 predicted; peaks 120 and 100
# MiB against 100) and other (team-b, 2 x 1 without a lease or a predicted peak: 0.25 s against 0.3).
GROUPS = [
    {"model": "gpt-tiny", "stages": 1, "replicas": 2, "micro_batches": 4, "host_class": "cpu/4c/2w", "runs": 2,
     "calibrated": 1, "iterations": 6, "predicted_s": 0.1, "measured_s": 0.11, "error_pct": -100 / 11,
     "predicted_peak_mib": 100.0, "measured_peak_mib": 110.0, "memory_error_pct": -100 / 11},
    {"model": "other", "stages": 2, "replicas": 1, "micro_batches": 2, "host_class": "cpu/0c/2w", "runs": 1,
     "calibrated": 0, "iterations": 1, "predicted_s": 0.3, "measured_s": 0.25, "error_pct": 20.0,
     "predicted_peak_mib": None, "measured_peak_mib": None, "memory_error_pct": None},
]


def metric(job_id: str, iteration: int, seconds: float, stage: int = 0, replica: int = 0, predicted: float = 0.1,
           peak_mib: int = 110, predicted_peak_mib: int = 100) -> job_pb2.IterationMetric:
    return job_pb2.IterationMetric(
        job_id=job_id, plan_version=1, iteration=iteration, stage_index=stage, replica_index=replica,
        iteration_time_s=seconds, predicted_iteration_time_s=predicted, peak_memory_bytes=peak_mib * MiB,
        predicted_peak_memory_bytes=predicted_peak_mib * MiB)


def seed(plane) -> dict[str, str]:
    """Hosts, tenants team-a and team-b, their jobs, plans, leases and metrics; returns the tenants' tokens."""
    admin = plane.store()
    hosts = []
    for name, cores in (("box-a", "4"), ("box-b", "6")):  # two agents on one machine
        h = host(name, ["cpu"])
        h.address, h.labels["cpu_cores"] = "10.0.0.7", cores
        hosts.append(admin.register_host(store_pb2.RegisterHostRequest(host=h)))
    tokens = {t: admin.create_tenant(store_pb2.CreateTenantRequest(name=t)).token for t in ("team-a", "team-b")}

    def job(tenant: str, model, micro_batches: int, explanation: str, leases: bool, rows) -> None:
        st = plane.store(tokens[tenant])
        made = st.create_job(store_pb2.CreateJobRequest(spec=job_spec("train", model=model)))
        pl = plan_msg(made.model_id, job_id=made.id)
        pl.version, pl.num_micro_batches, pl.explanation = 1, micro_batches, explanation
        st.create_plan(store_pb2.CreatePlanRequest(plan=pl))
        if leases:
            admin.acquire_leases(store_pb2.AcquireLeasesRequest(job_id=made.id, devices=[
                fleet_pb2.DeviceRef(host_id=h.id, device_index=0) for h in hosts]))
            admin.end_leases(store_pb2.EndLeasesRequest(job_id=made.id,
                                                        reason=fleet_pb2.LEASE_END_REASON_FINISHED))
        st.write_iteration_metrics(store_pb2.WriteIterationMetricsRequest(metrics=rows(made.id)))

    warm = lambda j: [metric(j, i, 1.0, replica=r, peak_mib=900) for i in range(3) for r in (0, 1)]  # noqa: E731
    job("team-a", gpt(), 4, "", True, lambda j: warm(j) + [
        metric(j, 3, 0.10), metric(j, 3, 0.12, replica=1, peak_mib=120), metric(j, 4, 0.11),
        metric(j, 4, 0.09, replica=1), metric(j, 5, 0.13), metric(j, 5, 0.10, replica=1)])
    job("team-a", gpt(), 4, f"Predicted 0.1 s.\n{CALIBRATED}: cal-1", True, lambda j: warm(j) + [
        metric(j, i, 0.10, replica=r, peak_mib=100) for i in (3, 4, 5) for r in (0, 1)])
    job("team-b", gpt(name="other"), 2, "", False, lambda j: [
        metric(j, i, t, stage=s, predicted=0.3, predicted_peak_mib=0)
        for i, times in ((0, (1, 1)), (1, (1, 1)), (2, (1, 1)), (3, (0.2, 0.25))) for s, t in enumerate(times)])
    return tokens


def check_groups(got: list[dict], want: list[dict], places: int = 9) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for key, value in w.items():
            if isinstance(value, float):
                assert g[key] == pytest.approx(value, abs=0.6 * 10 ** -places), (key, g)
            else:
                assert g[key] == value, (key, g)


def test_fidelity_reports_predicted_against_measured_from_the_store(tmp_path, monkeypatch, capsys) -> None:
    settings = make_settings(tmp_path / "d")
    plane = start_plane(settings, ("store",))
    ballast = in_process_cli(settings, monkeypatch, capsys)

    try:
        code, out, err = ballast("fidelity")
        assert (code, out) == (1, "") and NOTHING in err

        tokens = seed(plane)
        code, out, _ = ballast("fidelity", "--json")
        assert code == 0
        found = json.loads(out)
        check_groups(found["groups"], GROUPS)
        assert found["mae_pct"] == pytest.approx((100 / 11 + 20) / 2)
        assert found["memory_mae_pct"] == pytest.approx(100 / 11)
        assert sorted(r["measured_s"] for r in found["runs"]) == pytest.approx([0.1, 0.12, 0.25])

        code, out, _ = ballast("fidelity")
        assert code == 0
        row = [cell for cell in next(line for line in out.splitlines() if "gpt-tiny" in line).split() if cell != "│"]
        assert row == ["gpt-tiny", "1x2", "m4", "cpu/4c/2w", "2", "1", "6", "0.1000", "0.1100", "-9.1%", "100.0",
                       "110.0", "-9.1%"]
        assert "mean absolute error over 2 group(s): iteration time 14.5%, peak memory 9.1%" in out

        # the user guide's SQL, as the platform admin runs it, gives the same numbers rounded
        sql = next(text for name, _, text in guide_blocks() if name == "fidelity")
        code, out, _ = ballast("sql", "--json", sql)
        assert code == 0
        answer = json.loads(out)
        check_groups([dict(zip(answer["columns"], r, strict=True)) for r in answer["rows"]], GROUPS, places=1)

        png = tmp_path / "plots" / "fidelity.png"
        code, out, _ = ballast("fidelity", "--model", "gpt-tiny", "--plot", str(png))
        assert code == 0 and "other" not in out and f"plot: {png}" in out
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
        assert struct.unpack(">II", data[16:24]) == (700, 500)  # 7 x 5 inches at 100 dpi

        code, out, err = ballast("fidelity", "--model", "nobody")
        assert code == 1 and "no measured iterations of model 'nobody' yet: run a job first" in err

        monkeypatch.setenv("BALLAST_TOKEN", tokens["team-b"])  # a tenant sees its own jobs only
        code, out, _ = ballast("fidelity", "--json")
        assert code == 0
        check_groups(json.loads(out)["groups"], GROUPS[1:])
    finally:
        plane.stop()
