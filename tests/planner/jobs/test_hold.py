"""The planner's hold while the store's disk is full (services/planner/jobs/hold.py), its own logic: which jobs
are held and released, once each, and the HELD event a release records. The hold end to end, on a real full disk,
is tests/plane/test_disk_full.py."""

from __future__ import annotations

from ballast.v1 import job_pb2, plan_pb2
from services.planner.jobs.hold import StoreHold
from services.planner.jobs.running import Running
from services.runtime.disk import MESSAGE, DiskFull, refused_for_disk
from services.runtime.errors import ResourceExhausted, Unavailable


def running(job_id: str, hosts: list[str], stopping: str = "") -> Running:
    return Running(job=job_pb2.Job(id=job_id, plan_version=3), plan=plan_pb2.Plan(), hosts=hosts, world=len(hosts),
                   stopping=stopping, iteration=41)


def test_a_full_disk_holds_each_running_job_once_and_room_releases_them():
    sent, recorded = [], []
    hold = StoreHold(lambda host, message: sent.append((host, message)), recorded.extend)
    jobs = [running("a", ["h1", "h2"]), running("b", ["h3"]), running("c", ["h4"], stopping="cancelled")]
    hold.update([None, None], jobs)
    assert sent == [] and hold.held == []
    hold.update([DiskFull(), None], jobs)
    hold.update([DiskFull(), None], jobs)  # still full: nothing sent twice
    assert [(h, m.job_id, m.hold.held) for h, m in sent] == [("h1", "a", True), ("h2", "a", True), ("h3", "b", True)]
    assert all("disk is full" in m.hold.reason and m.version == 3 for _, m in sent)
    assert hold.held == ["a", "b"]  # a job already stopping is left to its stop
    sent.clear()
    hold.update([Unavailable("store restarting"), None], jobs)  # not room yet: still held
    assert sent == [] and recorded == []
    hold.forget("b")  # its workers ended meanwhile
    hold.update([None, None], jobs)
    assert [(h, m.job_id, m.hold.held) for h, m in sent] == [("h1", "a", False), ("h2", "a", False)]
    [event] = [r.event for r in recorded]
    assert event.job_id == "a" and event.type == "HELD" and event.attributes["reason"] == "store_disk_full"
    assert event.attributes["iteration"] == "41" and float(event.attributes["held_s"]) >= 0
    assert hold.held == []


def test_the_remote_form_of_a_full_disk_is_told_from_other_refusals():
    assert refused_for_disk(DiskFull()) and refused_for_disk(ResourceExhausted(MESSAGE, fix="free space"))
    assert not refused_for_disk(ResourceExhausted("rate limited")) and not refused_for_disk(None)
