"""The dashboard's page-building logic without a server: figures from rows, the pipeline Gantt, and the
login helpers."""

from __future__ import annotations

import pytest

from ballast.v1 import job_pb2, profile_pb2
from services.dashboard import auth, charts, gantt


def metric(iteration: int, stage: int, time_s: float, loss: float | None = None, predicted: float = 0.0):
    return job_pb2.IterationMetric(iteration=iteration, stage_index=stage, iteration_time_s=time_s,
                                   predicted_iteration_time_s=predicted, loss=loss or 0.0, has_loss=loss is not None)


def test_loss_is_the_mean_over_replicas_that_report_one_per_iteration():
    rows = [metric(1, 1, 0.3, 4.0), metric(1, 1, 0.3, 2.0), metric(1, 0, 0.3), metric(2, 1, 0.3, 1.0)]
    trace = charts.loss_figure(rows)["data"][0]
    assert trace["x"] == [1, 2] and trace["y"] == [3.0, 1.0] and trace["mode"] == "lines+markers"


def test_validation_losses_join_the_loss_plot_at_the_iteration_they_followed():
    evaluations = [job_pb2.Evaluation(iteration=2, loss=2.5), job_pb2.Evaluation(iteration=4, loss=2.0)]
    measured, validation = charts.loss_figure([metric(1, 1, 0.3, 4.0)], evaluations)["data"]
    assert validation["name"] == "validation loss" and validation["x"] == [1, 3] and validation["y"] == [2.5, 2.0]


def test_an_iteration_lasts_as_long_as_its_slowest_rank_beside_the_prediction():
    rows = [metric(1, 0, 0.2, predicted=0.25), metric(1, 1, 0.4, predicted=0.25), metric(2, 0, 0.3)]
    measured, predicted = charts.iteration_time_figure(rows)["data"]
    assert measured["x"] == [1, 2] and measured["y"] == [0.4, 0.3]
    assert predicted["x"] == [1] and predicted["y"] == [0.25]  # iteration 2 has no prediction


def test_the_timeline_orders_events_migrations_and_morphs_by_time():
    events = [{"type": "RUNNING", "message": "go", "at": "t1", "iso": "2026-01-01T00:00:01.000"}]
    migrations = [{"layer": 3, "from_stage": 0, "to_stage": 1, "bytes": 2 << 20, "duration_s": 0.01, "iteration": 7,
                   "plan_version": 2, "at": "t2", "iso": "2026-01-01T00:00:02.000"}]
    morphs = [{"cause": "host_lost", "from": "2x1", "to": "1x1", "failed_iteration": 9, "lost_iterations": 1,
               "recovery_s": 3.0, "detail": "vm-1", "at": "t0", "iso": "2026-01-01T00:00:00.500"}]
    rows = charts.timeline(events, migrations, morphs)
    assert [r["kind"] for r in rows] == ["morph", "event", "migration"]
    assert rows[2]["what"] == "layer 3: stage 0 \u2192 1" and "2.00 MiB" in rows[2]["detail"]
    figure = charts.timeline_figure(rows)
    assert {t["name"]: len(t["x"]) for t in figure["data"]} == {"event": 1, "migration": 1, "morph": 1}


@pytest.mark.parametrize("stages,micro_batches", [(1, 1), (2, 4), (4, 8), (3, 2)])
def test_gpipe_on_equal_stages_has_the_textbook_bubble(stages, micro_batches):
    ops = gantt.simulate([1.0] * stages, micro_batches, "gpipe")
    assert len(ops) == 2 * stages * micro_batches
    expected = (stages - 1) / (micro_batches + stages - 1)
    assert gantt.bubble_fraction(ops, stages) == pytest.approx(expected)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "varuna"])
def test_every_pass_waits_for_its_dependencies_and_a_stage_runs_one_at_a_time(schedule):
    ops = gantt.simulate([0.3, 0.6, 0.45], 5, schedule)
    end = {(op.kind, op.stage, op.micro_batch): op.end_s for op in ops}
    for op in ops:
        if op.kind == "F" and op.stage > 0:
            assert op.start_s >= end[("F", op.stage - 1, op.micro_batch)]
        if op.kind == "B":
            assert op.start_s >= end[("F", op.stage, op.micro_batch)]
            if op.stage < 2:
                assert op.start_s >= end[("B", op.stage + 1, op.micro_batch)]
    for stage in range(3):
        mine = sorted((op.start_s, op.end_s) for op in ops if op.stage == stage)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:], strict=False))


def test_1f1b_keeps_at_most_as_many_forwards_in_flight_as_stages_ahead():
    order = gantt.order("1f1b", stage=0, stages=4, micro_batches=8)
    assert order[:4] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)] and order[4] == ("B", 0)
    assert gantt.order("1f1b", stage=3, stages=4, micro_batches=8)[:2] == [("F", 0), ("B", 0)]


def test_a_pipeline_needs_stages_and_micro_batches():
    with pytest.raises(ValueError):
        gantt.simulate([], 4, "1f1b")
    with pytest.raises(ValueError):
        gantt.simulate([1.0], 0, "1f1b")
    figure = charts.gantt_figure([0.3, 0.3], 64, "1f1b")  # capped: bars stay readable
    assert len(figure["data"][0]["x"]) == 2 * gantt.MAX_MICRO_BATCHES


def test_the_profile_figure_is_time_per_sample_with_measured_sizes_marked():
    layer = profile_pb2.LayerProfile(index=0, samples=[
        profile_pb2.LayerSample(micro_batch_size=m, forward_s=0.1 * m, backward_s=0.2 * m) for m in (1, 2, 4)])
    profile = profile_pb2.Profile(layers=[layer, layer], measured_micro_batch_sizes=[1, 4])
    all_sizes, measured = charts.profile_figure(profile)["data"]
    assert all_sizes["x"] == [1, 2, 4] and all_sizes["y"] == pytest.approx([0.6] * 3)
    assert measured["x"] == [1, 4]


def test_bearer_tokens_come_from_the_header_before_the_cookie():
    assert auth.token_of({"authorization": "Bearer blt_a"}, {auth.COOKIE: "blt_b"}) == ("blt_a", True)
    assert auth.token_of({"authorization": "Basic eA=="}, {auth.COOKIE: "blt_b"}) == ("blt_b", False)
    assert auth.token_of({}, {}) == ("", False)


def test_the_login_form_is_checked_before_anything_is_sent():
    assert auth.login_token(b"token=blt_abc%2D1&x=1") == "blt_abc-1"
    for body, why in ((b"", "paste"), (b"token=a%20b", "not a bearer token"), ("token=é".encode(), "ASCII"),
                      (b"token=" + b"x" * 600, "not a bearer token")):
        with pytest.raises(ValueError, match=why):
            auth.login_token(body)


@pytest.mark.parametrize("target,expected", [("/jobs/job-1", "/jobs/job-1"), ("//evil.example", "/"),
                                             ("https://evil.example", "/"), ("/\\evil", "/"), ("/login", "/")])
def test_after_login_only_a_path_on_this_site(target, expected):
    assert auth.safe_next(target) == expected


def test_ids_are_plain():
    assert auth.valid_id("job-0a1b") and auth.valid_id("pln-1.2")
    assert not auth.valid_id("") and not auth.valid_id("../x") and not auth.valid_id("a b")


def test_plaintext_is_http_on_loopback_only(tmp_path):
    from services.dashboard.service import config
    from tests.harness import make_settings

    loopback = make_settings(tmp_path, plaintext=True)
    assert loopback.dashboard_url() == f"http://127.0.0.1:{loopback.dashboard_port}/"
    assert config(loopback).ssl_certfile is None
    with pytest.raises(ValueError, match="refusing to serve plaintext HTTP on 0.0.0.0"):
        config(make_settings(tmp_path, plaintext=True, host="0.0.0.0"))
    secure = config(make_settings(tmp_path))
    assert secure.ssl_certfile == str(tmp_path / "tls" / "server.crt")
    assert make_settings(tmp_path).dashboard_url().startswith("https://127.0.0.1:")
