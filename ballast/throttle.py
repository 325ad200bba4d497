"""Throttled calls as a client sees them: the server's retry advice, and an interceptor that waits it out.

A server over a tenant's rate limit (services/runtime/ratelimit.py) answers RESOURCE_EXHAUSTED with a
google.rpc.RetryInfo detail (grpc-status-details-bin) and the same delay as `retry-after-ms`. Such a call was
refused before it did anything, so trying it again -- a write included -- cannot apply it twice. Only unary
calls are retried here; a stream refused at its start raises as usual. A RESOURCE_EXHAUSTED without retry
advice (a message too large, too many open streams) is never retried.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

RETRY_AFTER_MS = "retry-after-ms"
MAX_RETRIES = 4  # so at most 5 attempts, as gRPC's own retry policy for UNAVAILABLE (ballast/client.py)
MAX_DELAY_S = 10.0  # advice beyond this is not waited for: the caller gets the error at once
JITTER = 0.2  # wait up to 20% longer than advised, so a tenant's throttled clients do not return in step


def retry_after(error: grpc.Call) -> float | None:
    """Seconds the server advises waiting before retrying a throttled call; None if it gave no advice."""
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    try:
        status = rpc_status.from_call(error)
    except ValueError:  # details that do not match the status: ignore them, read the plain header
        status = None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.ToTimedelta().total_seconds()
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_MS:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None


class _Details(
    collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                        "compression")),
    grpc.ClientCallDetails,
):
    pass


class ThrottleRetry(grpc.UnaryUnaryClientInterceptor):
    """Retries a unary call the server throttled with retry advice, after the advised delay, at most
    `retries` times and never past the call's own timeout. `sleep` and `clock` are injectable for tests."""

    def __init__(self, retries: int = MAX_RETRIES, max_delay_s: float = MAX_DELAY_S,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic):
        self.retries, self.max_delay_s, self.sleep, self.clock = retries, max_delay_s, sleep, clock

    def intercept_unary_unary(self, continuation, details: grpc.ClientCallDetails, request: Any):
        start = self.clock()
        outcome = continuation(details, request)
        for _ in range(self.retries):
            # a .future() call still running is handed back as it is: waiting here would block its caller
            if not isinstance(outcome, grpc.RpcError) or not outcome.done():
                return outcome
            delay = retry_after(outcome)
            if delay is None or delay > self.max_delay_s:
                return outcome
            delay *= 1 + JITTER * random.random()
            timeout = details.timeout
            if timeout is not None:
                timeout -= self.clock() - start + delay
                if timeout <= 0:
                    return outcome
            self.sleep(delay)
            outcome = continuation(_Details(details.method, timeout, details.metadata, details.credentials,
                                            details.wait_for_ready, getattr(details, "compression", None)), request)
        return outcome
