"""How non-store services reach the store: as their caller (tenant isolation) or as the platform."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc

from ballast.client import open_channel, pages
from ballast.config import Settings
from ballast.v1 import store_pb2, store_pb2_grpc
from services.runtime import context
from services.runtime.auth import Principal, hash_token
from services.runtime.errors import BallastError, Unauthenticated, Unavailable, from_code


def domain_error(exc: grpc.RpcError) -> BallastError:
    """Turn a downstream status back into a domain error, so it surfaces to our caller unchanged."""
    return from_code(exc.code().name, exc.details() or exc.code().name)


class StoreAuthenticator:
    """Resolves bearer tokens through StoreService.Authenticate, caching hits for `ttl_s` seconds."""

    def __init__(self, stub: store_pb2_grpc.StoreServiceStub, ttl_s: float = 30.0):
        self._stub = stub
        self._ttl = ttl_s
        self._cache: dict[str, tuple[float, Principal]] = {}
        self._lock = threading.Lock()

    def __call__(self, token: str) -> Principal:
        key = hash_token(token)
        with self._lock:
            hit = self._cache.get(key)
        if hit and hit[0] > time.monotonic():
            return hit[1]
        try:
            reply = self._stub.Authenticate(
                store_pb2.AuthenticateRequest(token=token), metadata=[("authorization", f"Bearer {token}")]
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise Unauthenticated(exc.details() or "unknown token") from None
            raise Unavailable(f"cannot reach the store to check the token: {exc.code().name}") from None
        principal = Principal(reply.tenant_id, reply.tenant_name, reply.admin)
        with self._lock:
            self._cache[key] = (time.monotonic() + self._ttl, principal)
        return principal


def store_stubs(settings: Settings) -> tuple[store_pb2_grpc.StoreServiceStub, store_pb2_grpc.StoreServiceStub]:
    """(as_caller, as_platform): the first forwards the incoming call's token and deadline, the second
    uses the service's own token (background work such as the lease sweeper)."""
    address = settings.address("store")
    service_token = settings.resolved_token()
    as_caller = open_channel(
        address, lambda: context.caller_token() or service_token, deadline_source=context.remaining_time
    )
    as_platform = open_channel(address, service_token)
    return store_pb2_grpc.StoreServiceStub(as_caller), store_pb2_grpc.StoreServiceStub(as_platform)


def anonymous_store(settings: Settings) -> store_pb2_grpc.StoreServiceStub:
    """A store stub that adds no token of its own (StoreAuthenticator sends the token it checks)."""
    return store_pb2_grpc.StoreServiceStub(open_channel(settings.address("store")))


def call(fn, request, **kwargs):
    """Call a stub method, re-raising a failure as the matching domain error."""
    try:
        return fn(request, **kwargs)
    except grpc.RpcError as exc:
        raise domain_error(exc) from None


def every_page(fn, request) -> Iterator:
    """Every reply of a paged List stub method, failures as domain errors (ballast.client.pages)."""
    return pages(lambda r: call(fn, r), request)
