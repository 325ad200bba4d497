"""The dashboard over HTTPS on a real plane (store, profiler and planner gRPC servers in this process):
who may see which page, the login cookie, the certificate, and every page rendered from stored rows."""

from __future__ import annotations

import json
import re
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from ballast.v1 import common_pb2, job_pb2, store_pb2
from tests.dashboard_support import Site, dashboard
from tests.harness import make_settings, start_plane
from tests.store_builders import gpt, job_spec, plan_msg, profile_msg


@dataclass
class World:
    site: Site
    admin: str
    member_a: str
    member_b: str
    viewer: str
    job: str
    plan: str
    profile: str


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[World]:
    settings = make_settings(tmp_path_factory.mktemp("dash"))
    plane = start_plane(settings)
    try:
        admin = plane.store()
        a = admin.create_tenant(store_pb2.CreateTenantRequest(name="team-a")).token
        b = admin.create_tenant(store_pb2.CreateTenantRequest(name="team-b")).token
        viewer = admin.create_tenant(store_pb2.CreateTenantRequest(name="watch",
                                                                   role=common_pb2.TENANT_ROLE_VIEWER)).token
        store = plane.store(a)
        model = store.create_model(store_pb2.CreateModelRequest(spec=gpt()))
        profile = store.create_profile(store_pb2.CreateProfileRequest(profile=profile_msg(model.id)))
        job = store.create_job(store_pb2.CreateJobRequest(spec=job_spec("dash-a", model=gpt())))
        plan = store.create_plan(store_pb2.CreatePlanRequest(plan=plan_msg(model.id, job_id=job.id,
                                                                           profile_id=profile.id)))
        # a morph deletes the metrics from its checkpoint on: recorded first, as a resumed job's would be
        morph = job_pb2.Morph(job_id=job.id, cause="worker_lost", detail="vm-1 lost", from_stages=2, from_replicas=1,
                              to_stages=1, to_replicas=1, failed_iteration=4)
        morph.detected_at.GetCurrentTime()
        morph.resumed_at.GetCurrentTime()
        admin.record_morph(store_pb2.RecordMorphRequest(morph=morph))
        store.write_iteration_metrics(store_pb2.WriteIterationMetricsRequest(metrics=[
            job_pb2.IterationMetric(job_id=job.id, iteration=i, stage_index=s, plan_version=1,
                                    iteration_time_s=0.5 + 0.1 * s, predicted_iteration_time_s=0.55,
                                    loss=5.0 - 0.1 * i, has_loss=s == 1)
            for i in range(1, 6) for s in (0, 1)]))
        store.record_layer_migration(store_pb2.RecordLayerMigrationRequest(migration=job_pb2.LayerMigration(
            job_id=job.id, layer_index=1, from_stage=0, to_stage=1, bytes=1 << 20, duration_s=0.02, iteration=3,
            plan_version=2)))
        with dashboard(plane) as site:
            yield World(site, plane.token, a, b, viewer, job.id, plan.id, profile.id)
    finally:
        plane.stop()


def test_an_unauthenticated_visit_is_refused(world):
    site = world.site
    browser = site.get("/jobs")
    assert browser.status == 303 and browser.headers["location"] == "/login?next=/jobs"
    script = site.get("/jobs", html=False)
    assert script.status == 401 and script.headers["www-authenticate"].startswith("Bearer")
    assert site.get(f"/jobs/{world.job}", token="blt_not-a-token", html=False).status == 401
    bad_cookie = site.request("/jobs", headers={"accept": "text/html", "cookie": "ballast_token=blt_nope"})
    assert bad_cookie.status == 303 and "ballast_token=" in bad_cookie.headers["set-cookie"]  # cleared
    assert site.get("/login").status == 200 and site.get("/healthz", html=False).body == "ok\n"
    assert site.get("/static/dashboard.css").status == 200
    js = site.get("/static/plotly.min.js")
    assert js.status == 200 and js.headers["content-type"].startswith("text/javascript") and len(js.body) > 1e6


def test_login_sets_an_http_only_strict_cookie_and_refuses_bad_tokens(world):
    site = world.site
    form = {"content-type": "application/x-www-form-urlencoded"}
    bad = site.request("/login?next=/queue", data=b"token=blt_wrong", headers=form)
    assert bad.status == 401 and "does not know that token" in bad.body and "set-cookie" not in bad.headers
    assert site.request("/login", data=b"token=" + b"x" * 10_000, headers=form).status == 413
    empty = site.request("/login", data=b"token=", headers=form)
    assert empty.status == 400 and "paste a bearer token" in empty.body
    good = site.request("/login?next=/queue", data=f"token={world.member_a}".encode(), headers=form)
    assert good.status == 303 and good.headers["location"] == "/queue"
    cookie = good.headers["set-cookie"]
    assert cookie.startswith(f"ballast_token={world.member_a};")
    assert {"HttpOnly", "SameSite=strict", "Secure", "Path=/"} <= {p.strip() for p in cookie.split(";")}
    cookie_only = site.request("/jobs", headers={"cookie": f"ballast_token={world.member_a}"})
    assert cookie_only.status == 200 and world.job in cookie_only.body
    away = site.request("/login?next=//evil.example/x", data=f"token={world.member_a}".encode(), headers=form)
    assert away.headers["location"] == "/"
    forged = site.request("/login", data=f"token={world.member_a}".encode(),
                          headers={**form, "origin": "https://evil.example"})
    assert forged.status == 403


def test_tenant_isolation_and_roles_apply(world):
    site = world.site
    for token in (world.member_a, world.viewer, world.admin):
        assert world.job in site.get("/jobs", token).body
        assert site.get(f"/jobs/{world.job}", token).status == 200
    assert world.job not in site.get("/jobs", world.member_b).body
    hidden = site.get(f"/jobs/{world.job}", world.member_b)
    assert hidden.status == 404 and world.job in hidden.body  # the store's NOT_FOUND, nothing of the job
    assert site.get(f"/plans/{world.plan}", world.member_b).status == 404
    assert world.plan not in site.get("/plans", world.member_b).body
    assert "team-b (member)" in site.get("/jobs", world.member_b).body
    assert "watch (viewer)" in site.get("/jobs", world.viewer).body


def figures(body: str) -> dict[str, dict]:
    """The figures a page embeds, by chart name."""
    found = re.findall(r'<script type="application/json" id="figure-([\w-]+)">(.*?)</script>', body, re.S)
    return {name: json.loads(text) for name, text in found}


def test_the_job_page_has_its_curves_and_its_migration_on_the_timeline(world):
    page = world.site.get(f"/jobs/{world.job}", world.viewer)
    assert page.status == 200
    figs = figures(page.body)
    loss = figs["loss"]["data"][0]
    assert loss["x"] == [1, 2, 3, 4, 5] and loss["y"][0] == pytest.approx(4.9)
    measured, predicted = figs["iteration-time"]["data"]
    assert measured["y"] == [pytest.approx(0.6)] * 5 and predicted["y"] == [pytest.approx(0.55)] * 5
    migration = next(t for t in figs["timeline"]["data"] if t["name"] == "migration")
    assert len(migration["x"]) == 1 and "layer 1: stage 0 \u2192 1" in migration["text"][0]
    morph = next(t for t in figs["timeline"]["data"] if t["name"] == "morph")
    assert len(morph["x"]) == 1 and "worker_lost: 2x1 \u2192 1x1" in morph["text"][0]
    assert 'data-kind="migration"' in page.body and 'data-kind="morph"' in page.body
    assert "<dd>team-a</dd>" in page.body  # the tenant's name, which a viewer may read
    assert 'http-equiv="refresh"' in page.body  # still SUBMITTED: the page reloads itself


def test_every_page_renders_for_the_viewer(world):
    site = world.site
    for path in ("/jobs", "/queue", "/fleet", "/plans", "/profiles", f"/plans/{world.plan}",
                 f"/profiles/{world.profile}"):
        reply = site.get(path, world.viewer)
        assert reply.status == 200, (path, reply.body[-500:])
        assert "script-src 'self'" in reply.headers["content-security-policy"]
        assert reply.headers["cache-control"] == "no-store" and "<script>" not in reply.body
    plan = site.get(f"/plans/{world.plan}", world.viewer).body
    assert "balanced two-stage pipeline" in plan and "gantt" in figures(plan)
    assert "per-sample" in figures(site.get(f"/profiles/{world.profile}", world.viewer).body)
    assert site.get("/jobs/bad%20id", world.viewer).status == 400
    assert site.get("/", world.viewer).headers["location"] == "/jobs"


def test_it_serves_https_with_the_control_planes_certificate(world):
    assert world.site.url.startswith("https://")
    with pytest.raises(urllib.error.URLError) as refused:  # a client without the CA cannot verify it
        urllib.request.urlopen(world.site.url + "healthz", context=ssl.create_default_context(), timeout=10)
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value)
    assert world.site.get("/healthz").status == 200  # verified with the data dir's CA
