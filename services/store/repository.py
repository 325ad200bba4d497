"""All reads and writes of the metadata store, one method per StoreService RPC.

The store servicer dispatches RPC `Foo` to `Repository.foo(principal, request)` by name, so the
class must carry every RPC method; it is composed from one part per group of RPCs under
`services/store/repo/`, and conversions between rows and protos live in `services/store/convert.py`.
Names other modules imported from here before the split are re-exported.
"""

from __future__ import annotations

from services.store.repo.admin import AdminStore
from services.store.repo.audit import AuditStore
from services.store.repo.base import (
    ADMIN_FIX,
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    RepositoryBase,
    new_id,
    utc_now,
)
from services.store.repo.calibrations import CalibrationStore
from services.store.repo.degraded import DegradedStore
from services.store.repo.hosts import HostStore
from services.store.repo.jobs import JobStore
from services.store.repo.leases import LeaseStore
from services.store.repo.morphs import MorphStore
from services.store.repo.plans import PlanStore
from services.store.repo.profiles import ModelStore
from services.store.repo.progress import METRICS_CHUNK, ProgressStore
from services.store.repo.queue import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_WORKER_WINDOW_S,
    FAILED,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    QueueStore,
    canonical_json,
    dedupe_key,
)
from services.store.repo.tenants import TENANT_NAME_RE, UNAUTHENTICATED_FIX, TenantStore

__all__ = [
    "ADMIN_FIX",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_WORKER_WINDOW_S",
    "FAILED",
    "MAX_PAGE_SIZE",
    "METRICS_CHUNK",
    "QUEUED",
    "RUNNING",
    "SUCCEEDED",
    "TENANT_NAME_RE",
    "UNAUTHENTICATED_FIX",
    "Repository",
    "canonical_json",
    "dedupe_key",
    "new_id",
    "utc_now",
]


class Repository(
    TenantStore, JobStore, ModelStore, LeaseStore, MorphStore, DegradedStore, CalibrationStore, HostStore, PlanStore,
    ProgressStore, QueueStore, AuditStore, AdminStore, RepositoryBase,
):
    """The store's data access; methods take the caller's Principal and the RPC's request proto."""
