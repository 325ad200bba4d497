"""The dashboard in a real browser (headless Chromium, Selenium) on a real control plane: store, profiler and
planner gRPC servers, a Celery worker, two executor agents training over gloo. Tenant alpha's job is submitted
here with online repartitioning and a deliberately unbalanced start, so the planner migrates a layer while it
trains; tenant beta's job waits in the queue over its one-device quota. The tests write screenshots of
the main pages to docs/screenshots (BALLAST_SCREENSHOT_DIR to put them elsewhere)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from ballast.v1 import common_pb2, fleet_pb2, job_pb2, model_pb2, services_pb2, store_pb2
from services.specs.policy import default_policy
from tests.dashboard_support import browser, dashboard, need_chromium
from tests.harness import ROOT, executor_plane, job_story, wait_for

pytestmark = pytest.mark.slow

S = job_pb2.JobState
ENDED = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
SHOTS = Path(os.environ.get("BALLAST_SCREENSHOT_DIR") or ROOT / "docs" / "screenshots")
WAIT_S = 60  # for a page element once its data is stored (a loaded 2-core machine)


def alpha_spec() -> job_pb2.JobSpec:
    """Blocks 4-6 of 6 switched off throughout: the 2-stage pipeline starts unbalanced and a layer moves."""
    model = model_pb2.ModelSpec(
        name="dash-gpt", family=model_pb2.MODEL_FAMILY_GPT,
        transformer=model_pb2.TransformerConfig(num_layers=6, hidden_size=128, num_heads=4, vocab_size=256,
                                                seq_length=64))
    toggles = [job_pb2.LayerToggle(layer_index=i, iteration=0, active=False) for i in (4, 5, 6)]
    return job_pb2.JobSpec(name="alpha-online", model=model, global_batch_size=8, iterations=50, seed=3,
                           pipeline_stages=2, online_repartition=True, layer_toggles=toggles)


def beta_spec() -> job_pb2.JobSpec:
    """Two stages for a tenant whose quota is one device: it waits in the queue (quota) throughout."""
    return job_pb2.JobSpec(name="beta-waits", model=alpha_spec().model, global_batch_size=8, iterations=10,
                           pipeline_stages=2)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    need_chromium()
    with executor_plane(tmp_path_factory.mktemp("dash"), f"dash-{uuid.uuid4().hex[:8]}") as plane:
        admin = plane.store()
        tokens = {name: admin.create_tenant(store_pb2.CreateTenantRequest(name=name, role=role)).token
                  for name, role in (("alpha", common_pb2.TENANT_ROLE_MEMBER), ("beta", common_pb2.TENANT_ROLE_MEMBER),
                                     ("watch", common_pb2.TENANT_ROLE_VIEWER))}
        policy = default_policy()
        policy.tenants.append(fleet_pb2.TenantPolicy(tenant="beta", device_quota=1))
        plane.client().fleet.SetPolicy(store_pb2.SetFleetPolicyRequest(policy=policy))
        with plane.client(tokens["alpha"]) as alpha, plane.client(tokens["beta"]) as beta:
            jobs = {"alpha": alpha.jobs.Submit(services_pb2.SubmitJobRequest(spec=alpha_spec())).id,
                    "beta": beta.jobs.Submit(services_pb2.SubmitJobRequest(spec=beta_spec())).id}
        with dashboard(plane) as site:
            yield plane, site, tokens, jobs


@pytest.fixture(scope="module")
def finished(world):
    """Alpha's job ended, with at least one layer migration; beta's waits in the queue."""
    plane, _, _, jobs = world
    client = plane.client()
    job = wait_for(lambda: (j := client.jobs.Get(store_pb2.GetRequest(id=jobs["alpha"]))).state in ENDED and j,
                   timeout=300, what="alpha's job to end",
                   story=lambda: job_story(client, jobs["alpha"], plane.settings.data_dir))
    assert job.state == S.JOB_STATE_SUCCEEDED, job.message
    migrations = client.store.ListLayerMigrations(store_pb2.ListLayerMigrationsRequest(job_id=job.id)).migrations
    assert migrations, "the unbalanced start was never rebalanced"
    wait_for(lambda: client.jobs.Get(store_pb2.GetRequest(id=jobs["beta"])).state == S.JOB_STATE_QUEUED,
             timeout=240, what="beta's job to wait in the queue")
    return job, migrations


def until(driver, condition, what: str, timeout: float = WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: condition(d), message=what)


def log_in(driver, url: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(url + "login")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "login-submit").click()
    until(driver, lambda d: d.find_elements(By.ID, "principal"), "the logged-in header")


def drawn(driver, *names: str) -> None:
    """Wait until plotly.js has drawn each named chart."""
    from selenium.webdriver.common.by import By

    for name in names:
        until(driver, lambda d, n=name: d.find_element(By.ID, f"chart-{n}").get_attribute("data-drawn") == "true",
              f"chart {name} drawn")


def shoot(driver, name: str) -> None:
    """The whole page as docs/screenshots/NAME.png: the viewport stretched to the page's height meanwhile."""
    height = driver.execute_script("return Math.max(document.body.scrollHeight, "
                                   "document.documentElement.scrollHeight)")
    metrics = {"width": 1400, "height": min(int(height), 4000), "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    try:
        SHOTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SHOTS / f"{name}.png"))
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_an_unauthenticated_visit_is_refused(world):
    from selenium.webdriver.common.by import By

    _, site, _, jobs = world
    with browser() as driver:
        driver.get(site.url + f"jobs/{jobs['alpha']}")
        until(driver, lambda d: "/login?next=" in d.current_url, "the redirect to the login form")
        assert not driver.find_elements(By.ID, "principal") and not driver.find_elements(By.ID, "job-summary")
        shoot(driver, "login")
        driver.find_element(By.ID, "token").send_keys("blt_not-a-token")
        driver.find_element(By.ID, "login-submit").click()
        error = until(driver, lambda d: d.find_elements(By.ID, "login-error"), "the login error")
        assert "does not know that token" in error[0].text


def test_a_submitted_job_appears_and_its_page_shows_loss_and_the_migration(world, finished):
    from selenium.webdriver.common.by import By

    _, site, tokens, jobs = world
    job, migrations = finished
    with browser() as driver:
        log_in(driver, site.url, tokens["alpha"])  # lands on /jobs
        row = until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-job="{job.id}"]'), "the job's row")
        assert "SUCCEEDED" in row[0].text
        shoot(driver, "jobs")
        row[0].find_element(By.LINK_TEXT, job.id).click()
        drawn(driver, "loss", "iteration-time", "timeline")
        points = driver.find_elements(By.CSS_SELECTOR, "#chart-loss .scatterlayer path.point")
        assert len(points) >= job.spec.iterations // 2, len(points)  # one per iteration with a loss
        traced = driver.execute_script(
            "return document.getElementById('chart-timeline').data.find(t => t.name === 'migration').x.length")
        assert traced == len(migrations)
        marks = driver.find_elements(By.CSS_SELECTOR, "#chart-timeline .scatterlayer .trace path.point")
        assert len(marks) >= len(migrations)
        rows = driver.find_elements(By.CSS_SELECTOR, '#timeline tr[data-kind="migration"]')
        assert len(rows) == len(migrations)
        shown = " ".join(r.text for r in rows)
        for m in migrations:
            assert f"layer {m.layer_index}: stage {m.from_stage} \u2192 {m.to_stage}" in shown, shown
        shoot(driver, "job")
        driver.find_element(By.ID, "job-plan").click()
        drawn(driver, "gantt")
        assert driver.find_element(By.ID, "explanation").text
        shoot(driver, "plan")


def test_a_member_does_not_see_another_tenants_job(world, finished):
    from selenium.webdriver.common.by import By

    _, site, tokens, jobs = world
    with browser() as driver:
        log_in(driver, site.url, tokens["beta"])
        until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-job="{jobs["beta"]}"]'), "beta's own job")
        assert jobs["alpha"] not in driver.page_source
        driver.get(site.url + f"jobs/{jobs['alpha']}")
        assert "Error 404" in driver.find_element(By.TAG_NAME, "h1").text
        assert not driver.find_elements(By.ID, "chart-loss")
        driver.get(site.url + "queue")
        queue = driver.find_element(By.ID, "queue").text
        assert jobs["beta"] in queue and "quota" in queue


def test_the_viewer_sees_every_page_and_screenshots_are_written(world, finished):
    from selenium.webdriver.common.by import By

    _, site, tokens, jobs = world
    with browser() as driver:
        log_in(driver, site.url, tokens["watch"])
        # the list reloads itself while beta's job waits: wait for a loaded page rather than read one mid-reload
        until(driver, lambda d: all(d.find_elements(By.CSS_SELECTOR, f'tr[data-job="{j}"]') for j in jobs.values()),
              "both tenants' jobs listed for the viewer")
        driver.get(site.url + "fleet")
        drawn(driver, "utilisation")
        assert len(driver.find_elements(By.CSS_SELECTOR, "#fleet tbody tr")) == 2
        shoot(driver, "fleet")
        driver.get(site.url + "queue")
        assert jobs["beta"] in driver.find_element(By.ID, "queue").text
        shoot(driver, "queue")
        driver.get(site.url + "plans")
        shoot(driver, "plans")
        driver.get(site.url + "profiles")
        link = driver.find_element(By.CSS_SELECTOR, "#profiles tbody tr a")
        link.click()
        drawn(driver, "per-sample")
        shoot(driver, "profile")
    for name in ("fleet", "queue", "plans", "profile"):
        assert (SHOTS / f"{name}.png").stat().st_size > 10_000, name
