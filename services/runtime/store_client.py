"""The Store interface over gRPC, as other services reach the store: as their caller (tenant isolation),
as the platform (background work), or anonymously to resolve bearer tokens."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from ballast.client import TokenSource, open_channel
from ballast.config import Settings
from ballast.transport import client_transport
from ballast.v1 import common_pb2, store_pb2, store_pb2_grpc
from services.runtime import context
from services.runtime.auth import ADMIN, MEMBER, Principal, PrincipalCache
from services.runtime.errors import BallastError, Unauthenticated, Unavailable
from services.runtime.ratelimit import FORWARDED_BY
from services.runtime.remote import domain_error
from services.runtime.rpcs import changes_state
from services.runtime.store_api import SERVICE, Store, implement

# Reads are safe to repeat, so a store restarting or a database blip costs them a short wait, not a
# failure; writes are never repeated here (a retried write could land twice). The channel's own gRPC
# retries come first: once a failed call has taken longer than the budget, it is not tried again, so
# the two never multiply into a long hang while the store is down.
READ_ONLY = frozenset(m.name for m in SERVICE.methods if not changes_state(m.name))
# The reads a read-only store serves when there is one (docs/architecture.md, "Store reads"). Token checks stay with the
# store that rotates and revokes tokens, so a revocation is not held up by a second cache; SQL stays there too, as a
# query may rightly run longer than READER_ATTEMPT_S (its timeout is the caller's) and would then run twice.
READER_SERVES = READ_ONLY - {"Authenticate", "Query"}
READER_BENCHED_S = 5.0  # after the reader failed to answer, reads go straight to the store this long ...
READER_HUNG_BENCHED_S = 30.0  # ... or this long after it took READER_ATTEMPT_S without answering
READER_ATTEMPT_S = 3.0  # the most one read waits for the reader before the store is asked (reads take ms)
LEAVE_READER = {grpc.StatusCode.UNAVAILABLE: READER_BENCHED_S, grpc.StatusCode.UNIMPLEMENTED: READER_BENCHED_S,
                grpc.StatusCode.DEADLINE_EXCEEDED: READER_HUNG_BENCHED_S}
RETRY_DELAYS_S = (0.05, 0.2, 0.5)
RETRY_BUDGET_S = 1.5


def _rpc(name: str) -> Callable[..., Any]:
    delays = RETRY_DELAYS_S if name in READ_ONLY else ()
    return lambda self, request: self._call(name, request, delays)


@implement(_rpc)
class RemoteStore(Store):
    """Store over a channel to StoreService; whose token the channel sends decides who the calls run as.
    With `reads`, a channel to a read-only store over the same database, the reads go there first."""

    def __init__(self, channel: grpc.Channel, reads: grpc.Channel | None = None):
        """`reads` should be opened without retries (open_channel): a reader away is then left at once."""
        self._stub = store_pb2_grpc.StoreServiceStub(channel)
        self._reader = store_pb2_grpc.StoreServiceStub(reads) if reads is not None else None
        self._reader_benched_until = 0.0

    def _call(self, name: str, request: Message, delays: tuple[float, ...], **kwargs: Any) -> Any:
        """One RPC; a failure re-raised as the matching domain error, UNAVAILABLE retried after each delay
        while within RETRY_BUDGET_S. A read goes to the reader first, if there is one and it is not benched."""
        if self._reader is not None and name in READER_SERVES and time.monotonic() >= self._reader_benched_until:
            answered, reply = self._from_reader(name, request, kwargs)
            if answered:
                return reply
        start = time.monotonic()
        for delay in (*delays, None):
            try:
                return getattr(self._stub, name)(request, **kwargs)
            except grpc.RpcError as exc:
                late = delay is None or time.monotonic() - start + delay > RETRY_BUDGET_S
                if late or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise domain_error(exc) from None
            time.sleep(delay)
        raise AssertionError("unreachable")

    def _from_reader(self, name: str, request: Message, kwargs: dict[str, Any]) -> tuple[bool, Any]:
        """(True, reply) from the reader, or (False, None) when the store should answer instead: the reader is
        away (UNAVAILABLE), older than the call (UNIMPLEMENTED) or hung (no answer in READER_ATTEMPT_S while the
        caller could still wait); it is then benched. Any other failure is the answer, as the store's would be."""
        remaining = context.remaining_time()
        attempt = READER_ATTEMPT_S if remaining is None else min(READER_ATTEMPT_S, remaining)
        try:
            return True, getattr(self._reader, name)(request, timeout=attempt, **kwargs)
        except grpc.RpcError as exc:
            code = exc.code()
            caller_out_of_time = code == grpc.StatusCode.DEADLINE_EXCEEDED and attempt < READER_ATTEMPT_S
            if code not in LEAVE_READER or caller_out_of_time:
                raise domain_error(exc) from None
            self._reader_benched_until = time.monotonic() + LEAVE_READER[code]
            return False, None


class _TokenChecker(RemoteStore):
    """Sends no token of its own: Authenticate goes out bearing the very token it asks about, which is
    what the store's auth hook checks before answering."""

    def authenticate(self, request: store_pb2.AuthenticateRequest) -> common_pb2.Principal:
        bearer = [("authorization", f"Bearer {request.token}")]
        return self._call("Authenticate", request, RETRY_DELAYS_S, metadata=bearer)


def forwarded(settings: Settings) -> tuple[tuple[str, str], ...]:
    """The header that tells the store a call is forwarded for a tenant whose own call this service already
    admitted, so the store's rate limit does not count it again (services/runtime/ratelimit.py)."""
    token = settings.resolved_token()
    return ((FORWARDED_BY, token),) if token else ()


def remote_stores(settings: Settings) -> tuple[RemoteStore, RemoteStore]:
    """(as_caller, as_platform): the first forwards the incoming call's token and deadline, the second
    uses the service's own token and marks its calls background work (the lease sweeper, the worker's
    preparation, heartbeats, audit records), which the store's writes let calls someone waits on go before."""
    service_token = settings.resolved_token()
    background = ((context.LANE_HEADER, context.BACKGROUND),)  # no caller waits: the store serves it after them
    as_caller = store_over(settings, lambda: context.caller_token() or service_token,
                           deadline_source=context.remaining_time, metadata=forwarded(settings))
    return as_caller, store_over(settings, service_token, metadata=background)


def store_over(settings: Settings, token: TokenSource, **options: Any) -> RemoteStore:
    """A RemoteStore sending `token` (open_channel's other `options` alike) to the store, and its reads to the
    store's read-only twin when the settings name one (docs/architecture.md, "Store reads"): that channel without
    retries."""
    transport = client_transport(settings)
    reader = settings.store_read_address
    return RemoteStore(open_channel(settings.address("store"), token, transport=transport, **options),
                       open_channel(reader, token, transport=transport, retries=False, **options) if reader else None)


def anonymous_store(settings: Settings) -> RemoteStore:
    """The store for StoreAuthenticator: each Authenticate call carries only the token it checks."""
    return _TokenChecker(open_channel(settings.address("store"), transport=client_transport(settings),
                                      metadata=forwarded(settings)))


class StoreAuthenticator:
    """Resolves bearer tokens through Store.authenticate, caching hits for `ttl_s` seconds."""

    def __init__(self, store: Store, ttl_s: float = 5.0):  # a rotated token stops working within it
        self._store = store
        self._cache = PrincipalCache(ttl_s)

    def __call__(self, token: str) -> Principal:
        hit = self._cache.get(token)
        if hit is not None:
            return hit
        stamp = self._cache.stamp()
        try:
            reply = self._store.authenticate(store_pb2.AuthenticateRequest(token=token))
        except Unauthenticated:
            raise
        except BallastError as exc:
            raise Unavailable(f"cannot reach the store to check the token: {exc.code}") from None
        principal = Principal.of(reply.tenant_id, reply.tenant_name, common_pb2.TenantRole.Name(reply.role)
                                   if reply.role else ADMIN if reply.admin else MEMBER)
        self._cache.put(token, principal, stamp)
        return principal
