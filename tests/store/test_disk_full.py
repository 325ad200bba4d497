"""A full disk under the store (issue 41, item 10): a write is refused with RESOURCE_EXHAUSTED that names the disk,
nothing is half-written, and the same call succeeds once space returns. SQLite on a real 8 MiB tmpfs, in process
and through a real store server."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from ballast.v1 import job_pb2, store_pb2
from services.runtime.errors import ResourceExhausted
from tests.harness import small_disk as mounted
from tests.store_fixtures import new_job, open_store


@pytest.fixture
def small_disk(tmp_path):
    with mounted(tmp_path / "disk", "8m") as disk:
        yield disk


def fill(disk) -> None:
    """Take every free byte of the disk with one file."""
    with open(disk / "filler", "wb", buffering=0) as out:  # unbuffered: no partial chunk left to flush at close
        try:
            while True:
                out.write(b"\0" * (64 << 10))
                out.flush()
        except OSError:
            pass


@pytest.mark.parametrize("backend", ["sqlite", "remote"])
def test_a_full_disk_refuses_writes_by_name_and_the_store_recovers(small_disk, tmp_path, backend) -> None:
    url = f"sqlite:///{small_disk / 'ballast.db'}"
    with open_store(url, backend, tmp_path) as st:
        job = new_job(st)
        fill(small_disk)
        before = st.count("job_events")
        note = store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(job_id=job.id, type="NOTE", message="x" * 4000))
        refused = 0
        for _ in range(200):  # until the database's free pages are used up too
            try:
                st.as_(st.a).append_job_event(note)
            except ResourceExhausted as err:  # DiskFull in process; rebuilt from its status over gRPC
                assert err.code == "RESOURCE_EXHAUSTED" and "disk is full" in err.message and err.fix, err
                refused += 1
                break
        assert refused == 1
        stored = st.count("job_events")
        assert stored >= before  # what was written before the disk filled is there, whole
        (small_disk / "filler").unlink()
        st.as_(st.a).append_job_event(note)  # space is back: the same call works
        assert st.count("job_events") == stored + 1
        with st.engine.connect() as conn:
            assert conn.execute(sa.text("PRAGMA integrity_check")).scalar_one() == "ok"
