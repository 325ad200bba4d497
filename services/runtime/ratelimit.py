"""Per-tenant rate limits: a token bucket per (tenant, gRPC service), so one tenant's flood cannot take the
servers' threads and the database from the others.

The interceptor chain (services/runtime/interceptors.py) calls `RateLimiter.admit` right after authentication.
Not counted: the platform admin (the services call each other with its token), and a call a service forwards
on a tenant's behalf (the planner's and profiler's store calls as their caller), which carries the service
token in FORWARDED_BY: the tenant's own call was admitted where it came in, and charging each store round trip
again would throttle a tenant for the planner's fan-out. A refused call did nothing; it ends RESOURCE_EXHAUSTED
with a message naming the limit and the fix, a google.rpc.RetryInfo detail and `retry-after-ms`, both the
time until the bucket holds a token, which the client SDK waits out (ballast/throttle.py).
"""

from __future__ import annotations

import hmac
import math
import threading
import time
from collections.abc import Callable, Iterable

from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from ballast.config import Settings
from ballast.throttle import RETRY_AFTER_MS
from services.runtime.auth import Principal, hash_token
from services.runtime.errors import ResourceExhausted

FORWARDED_BY = "ballast-forwarded-by"  # a service's own token, on calls it makes as its caller
STATUS_DETAILS = "grpc-status-details-bin"  # the rich status (google.rpc.Status), as grpcio-status reads it
FIX = ("wait the advised delay (RetryInfo, or the retry-after-ms trailer) and retry, as the Ballast SDK does; "
       "spread the calls out, or ask the platform admin to raise BALLAST_RATE_LIMIT_RPS / BALLAST_RATE_LIMIT_BURST")


class TokenBucket:
    """`rate` tokens a second, holding at most `burst`; starts full. Not locked: RateLimiter holds the lock."""

    def __init__(self, rate: float, burst: int, now: float):
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float) -> float:
        """Take a token: 0.0 if there was one, else the seconds until there will be one (none taken)."""
        if now > self.stamp:
            self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class Throttled(ResourceExhausted):
    """A call over its tenant's rate limit; `trailing` is the retry advice the interceptor sends with it."""

    def __init__(self, tenant: str, service: str, rate: float, burst: int, retry_after_s: float):
        self.retry_after_ms = max(1, math.ceil(retry_after_s * 1000))
        super().__init__(
            f"tenant {tenant!r} is over its rate limit for {service.rsplit('.', 1)[-1]} ({rate:g} calls/s, "
            f"burst {burst}); retry in {self.retry_after_ms} ms", fix=FIX)

    @property
    def trailing(self) -> tuple[tuple[str, str | bytes], ...]:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(self.retry_after_ms)
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        # The rich status must repeat the call's code and message exactly (the interceptor aborts with str(self))
        status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=str(self), details=[detail])
        return (STATUS_DETAILS, status.SerializeToString()), (RETRY_AFTER_MS, str(self.retry_after_ms))


class RateLimiter:
    """Token buckets per (tenant, gRPC service), thread-safe; `rate` <= 0 turns limiting off.
    `service_token` is the platform token whose FORWARDED_BY calls are not counted."""

    def __init__(self, rate: float, burst: int, service_token: str = "",
                 clock: Callable[[], float] = time.monotonic):
        if not rate >= 0 or math.isinf(rate):
            raise ValueError(f"rate_limit_rps: {rate!r} must be a finite number >= 0 "
                             "(BALLAST_RATE_LIMIT_RPS; 0 turns the limits off)")
        if rate > 0 and burst < 1:
            raise ValueError(f"rate_limit_burst: {burst!r} must be >= 1 while rate_limit_rps is set "
                             "(BALLAST_RATE_LIMIT_BURST; at least 1 call must get through)")
        self.rate, self.burst, self.clock = rate, burst, clock
        self._service_digest = hash_token(service_token) if service_token else ""
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, settings: Settings) -> RateLimiter:
        return cls(settings.rate_limit_rps, settings.rate_limit_burst, settings.resolved_token())

    def wait_s(self, tenant_id: str, service: str) -> float:
        """Take a token from the tenant's bucket for `service`: 0.0, or the seconds until one is there."""
        with self._lock:
            now = self.clock()
            bucket = self._buckets.get((tenant_id, service))
            if bucket is None:
                bucket = self._buckets[(tenant_id, service)] = TokenBucket(self.rate, self.burst, now)
            return bucket.take(now)

    def admit(self, principal: Principal, method: str, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        """Let the call of `method` ("/pkg.Service/Method") through or raise Throttled."""
        if self.rate <= 0 or principal.admin or self._forwarded(metadata):
            return
        service = method.strip("/").split("/", 1)[0]
        wait = self.wait_s(principal.tenant_id, service)
        if wait > 0:
            raise Throttled(principal.tenant_name, service, self.rate, self.burst, wait)

    def _forwarded(self, metadata: Iterable[tuple[str, str | bytes]]) -> bool:
        if not self._service_digest:
            return False
        for key, value in metadata:
            if key == FORWARDED_BY and isinstance(value, str):
                return hmac.compare_digest(hash_token(value), self._service_digest)
        return False
