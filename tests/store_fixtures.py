"""The store suite's one factory: a `Store` over SQLite, PostgreSQL, or a real store server over gRPC.

A store test exercises an RPC as `st.as_(principal).create_job(request)`. Locally that object
calls the Repository in-process; on the `remote` backend it is a client on a loopback channel that
sends the principal's bearer token, so the same test proves the repository, the servicer's by-name
dispatch and its error mapping at once. Row counts and the fake clock stay in the test's hands on
every backend: the remote server serves the very Repository (engine, clock) the test holds.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import sqlalchemy as sa

from ballast.client import open_channel
from ballast.config import Settings, load_settings
from ballast.transport import client_transport
from ballast.v1 import job_pb2, queue_pb2, store_pb2
from services.runtime.auth import Principal
from services.runtime.store_api import Store as StoreAPI
from services.runtime.store_client import RemoteStore
from services.specs.user_inputs import UserInputs
from services.store import schema
from services.store.db import create_engine
from services.store.local import LocalStore
from services.store.repository import Repository
from services.store.service import build_server
from tests.store_builders import job_spec

JS = job_pb2.JobState
ADMIN_TOKEN = "blt_test-admin-token"
FACTORY = "mypkg.models:build"


class FakeClock:
    """Advances one microsecond per reading so creation order is strict; tests jump it explicitly.

    Locked: server threads and a test's own threads read it at once, and two equal readings would
    make creation order (and so list order) a coin toss.
    """

    def __init__(self) -> None:
        self.t = datetime(2026, 1, 1, tzinfo=UTC)
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            self.t += timedelta(microseconds=1)
            return self.t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.t += timedelta(seconds=seconds)


# Pairs of leases on one device whose [started_at, ended_at) intervals overlap (an open end is "still live"): a
# device leased to two jobs at once. Store, plane and fleet-scale checks all count them this way.
OVERLAPS = """
SELECT count(*) FROM device_leases a JOIN device_leases b
  ON a.host_id = b.host_id AND a.device_index = b.device_index AND a.id < b.id
WHERE (b.ended_at IS NULL OR a.started_at < b.ended_at) AND (a.ended_at IS NULL OR b.started_at < a.ended_at)
"""

@dataclass
class Store:
    """One backend's store plus its internals; `as_(who)` is the `store_api.Store` a test calls as `who`."""

    repo: Repository
    engine: sa.Engine
    clock: FakeClock
    admin: Principal
    a: Principal
    b: Principal
    backend: str
    tokens: dict[str, str]  # tenant id -> bearer token, read by the remote channels on every call
    connect: Callable[[Principal], StoreAPI]
    _clients: dict[Principal, StoreAPI] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def as_(self, who: Principal) -> StoreAPI:
        with self._lock:  # tests call from threads too: one client per principal, never two
            if who not in self._clients:
                self._clients[who] = self.connect(who)
            return self._clients[who]

    def rekey(self, who: Principal, token: str) -> None:
        """`who` now authenticates with `token` (after `repo.ensure_admin` rotated it)."""
        self.tokens[who.tenant_id] = token

    def count(self, table: str) -> int:
        with self.engine.connect() as conn:
            return conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()


@contextlib.contextmanager
def open_store(url: str, backend: str, data_dir: Path) -> Iterator[Store]:
    """A migrated store on the empty database at `url` with an admin and tenants team-a and team-b.

    `backend` "remote" serves the repository on a loopback port and hands out RemoteStores on real
    channels; any other value hands out LocalStores. Server, channels and engine go at exit.
    """
    schema.upgrade(url)
    engine = create_engine(url)
    clock = FakeClock()
    repo = Repository(engine, now=clock, user_inputs=UserInputs.of([FACTORY]))
    try:
        admin = repo.ensure_admin(ADMIN_TOKEN)
        tokens = {admin.tenant_id: ADMIN_TOKEN}
        tenants = []
        for name in ("team-a", "team-b"):
            made = repo.create_tenant(admin, store_pb2.CreateTenantRequest(name=name))
            tenants.append(repo.principal_for_token(made.token))
            tokens[tenants[-1].tenant_id] = made.token
        a, b = tenants
        with contextlib.ExitStack() as stack:
            if backend == "remote":
                settings = load_settings({}, data_dir=data_dir, store_metrics_port=0)  # no fixed port to collide on
                connect = stack.enter_context(_served(repo, tokens, settings))
            else:
                connect = functools.partial(LocalStore, repo)
            yield Store(repo, engine, clock, admin, a, b, backend, tokens, connect)
    finally:
        engine.dispose()


@contextlib.contextmanager
def _served(
    repo: Repository, tokens: dict[str, str], settings: Settings
) -> Iterator[Callable[[Principal], StoreAPI]]:
    """Serve `repo` on a free loopback port; yields who -> RemoteStore sending who's current token."""
    server = build_server(settings, repo.engine, "127.0.0.1:0", repo=repo).start()
    channels: list[grpc.Channel] = []

    def connect(who: Principal) -> StoreAPI:
        channels.append(open_channel(f"127.0.0.1:{server.port}", lambda: tokens[who.tenant_id],
                                     transport=client_transport(settings)))
        return RemoteStore(channels[-1])

    try:
        yield connect
    finally:
        for channel in channels:
            channel.close()
        server.stop(0)
        # grpc never shuts down the executor a server was given: join its threads here, or each remote
        # test would leave idle workers behind until the garbage collector found them.
        pool = getattr(getattr(server._grpc, "_state", None), "thread_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)


# --- calls most tests make -------------------------------------------------------------------------


def new_job(st: Store, who: Principal | None = None, name: str = "train", **kw) -> job_pb2.Job:
    return st.as_(who or st.a).create_job(store_pb2.CreateJobRequest(spec=job_spec(name, **kw)))


def move(st: Store, job_id: str, state: int, who: Principal | None = None, **kw) -> job_pb2.Job:
    return st.as_(who or st.a).transition_job(store_pb2.TransitionJobRequest(id=job_id, state=state, **kw))


def events(st: Store, job_id: str, who: Principal | None = None, **kw) -> list[job_pb2.JobEvent]:
    req = store_pb2.ListJobEventsRequest(job_id=job_id, **kw)
    return list(st.as_(who or st.a).list_job_events(req).events)


def enqueue(st: Store, payload: str, who: Principal | None = None, **kw) -> store_pb2.EnqueueRequestResponse:
    req = store_pb2.EnqueueRequestRequest(kind="planner.search", payload_json=payload, **kw)
    return st.as_(who or st.a).enqueue_request(req)


def claim(st: Store, id_: str, worker: str, lease: float = 30.0) -> store_pb2.ClaimRequestResponse:
    req = store_pb2.ClaimRequestRequest(id=id_, worker=worker, lease_seconds=lease)
    return st.as_(st.admin).claim_request(req)


def complete(st: Store, id_: str, token: str, result: str = '{"ok": true}') -> queue_pb2.QueuedRequest:
    req = store_pb2.CompleteRequestRequest(id=id_, lease_token=token, result_json=result)
    return st.as_(st.admin).complete_request(req)
