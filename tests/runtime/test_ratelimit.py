"""Per-tenant token buckets (services/runtime/ratelimit.py) and the client's retry on their advice
(ballast/throttle.py), on an injected clock: no sleeps, no timing."""

from __future__ import annotations

import threading

import grpc
import pytest

from ballast.throttle import RETRY_AFTER_MS, ThrottleRetry, retry_after
from services.runtime.auth import Principal
from services.runtime.ratelimit import FORWARDED_BY, RateLimiter, Throttled, TokenBucket

A = Principal("tnt-a", "team-a")
B = Principal("tnt-b", "team-b")
ADMIN = Principal("tnt-admin", "admin", admin=True)
SUBMIT = "/ballast.v1.JobService/Submit"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_lets_its_burst_through_then_one_call_per_refill() -> None:
    bucket = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.5)  # a token every 1/rate s
    assert bucket.take(0.25) == pytest.approx(0.25)  # refused calls take nothing: the wait only shrinks
    assert bucket.take(0.5) == 0.0
    assert bucket.take(0.5) == pytest.approx(0.5)


def test_a_bucket_never_holds_more_than_its_burst_and_ignores_a_clock_going_back() -> None:
    bucket = TokenBucket(rate=10.0, burst=2, now=0.0)
    assert [bucket.take(1000.0) for _ in range(3)] == [0.0, 0.0, pytest.approx(0.1)]
    assert bucket.take(999.0) == pytest.approx(0.1)


def test_tenants_and_services_have_buckets_of_their_own() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=1.0, burst=2, clock=clock)
    for _ in range(2):
        limiter.admit(A, SUBMIT, ())
    with pytest.raises(Throttled) as caught:
        limiter.admit(A, SUBMIT, ())
    assert caught.value.code == "RESOURCE_EXHAUSTED" and caught.value.retry_after_ms == 1000
    for _ in range(2):
        limiter.admit(B, SUBMIT, ())  # team-b is untouched by team-a's flood
        limiter.admit(A, "/ballast.v1.StoreService/ListJobs", ())  # and team-a's store budget too
    clock.now += 1.0
    limiter.admit(A, SUBMIT, ())


def test_the_admin_and_forwarded_calls_are_never_counted() -> None:
    limiter = RateLimiter(rate=1.0, burst=1, service_token="svc-token", clock=Clock())
    for _ in range(50):
        limiter.admit(ADMIN, SUBMIT, ())
        limiter.admit(A, SUBMIT, ((FORWARDED_BY, "svc-token"),))
    limiter.admit(A, SUBMIT, ())
    with pytest.raises(Throttled):  # a made-up forwarding header counts like any call
        limiter.admit(A, SUBMIT, ((FORWARDED_BY, "guess"),))


def test_rate_zero_turns_limits_off_and_bad_settings_name_the_setting() -> None:
    limiter = RateLimiter(rate=0, burst=0)
    for _ in range(1000):
        limiter.admit(A, SUBMIT, ())
    with pytest.raises(ValueError, match="BALLAST_RATE_LIMIT_RPS"):
        RateLimiter(rate=-1, burst=10)
    with pytest.raises(ValueError, match="BALLAST_RATE_LIMIT_RPS"):
        RateLimiter(rate=float("nan"), burst=10)
    with pytest.raises(ValueError, match="BALLAST_RATE_LIMIT_BURST"):
        RateLimiter(rate=5, burst=0)


def test_concurrent_callers_get_exactly_the_burst() -> None:
    limiter = RateLimiter(rate=1.0, burst=100, clock=Clock())  # the clock stands still: no refill
    admitted: list[int] = []

    def caller() -> None:
        for _ in range(50):
            admitted.append(limiter.wait_s("tnt-a", "svc") == 0.0)

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(admitted) == 100


class Refused(grpc.RpcError, grpc.Call):
    """A finished call as the channel hands a failure to an interceptor."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailing

    def done(self) -> bool:
        return True

    def initial_metadata(self):
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self):
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback) -> bool:
        return False


def throttled(after_ms: int = 250) -> Refused:
    exc = Throttled("team-a", "ballast.v1.JobService", 5.0, 10, after_ms / 1000)
    return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), exc.trailing)


def test_the_refusal_names_the_limit_and_the_fix_and_carries_retry_info() -> None:
    refused = throttled(250)
    assert "rate limit for JobService (5 calls/s, burst 10)" in refused.details()
    assert "BALLAST_RATE_LIMIT_RPS" in refused.details()
    assert retry_after(refused) == pytest.approx(0.25)  # read from google.rpc.RetryInfo
    header_only = Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", ((RETRY_AFTER_MS, "40"),))
    assert retry_after(header_only) == pytest.approx(0.04)
    assert retry_after(Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many open streams")) is None
    assert retry_after(Refused(grpc.StatusCode.UNAVAILABLE, "x", ((RETRY_AFTER_MS, "40"),))) is None


class Details:
    method, metadata, credentials, wait_for_ready, compression = "/m", (), None, None, None

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout


def run(outcomes: list, timeout: float | None = None, retries: int = 4) -> tuple[object, list, list[float]]:
    """Drive ThrottleRetry over canned outcomes; (what it returned, the calls' timeouts, what it slept)."""
    clock, slept, timeouts = Clock(), [], []
    pending = list(outcomes)

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    def continuation(details, request):
        timeouts.append(details.timeout)
        return pending.pop(0)

    retry = ThrottleRetry(retries=retries, sleep=sleep, clock=clock)
    return retry.intercept_unary_unary(continuation, Details(timeout), "req"), timeouts, slept


def test_the_sdk_waits_the_advised_delay_then_retries() -> None:
    result, timeouts, slept = run([throttled(250), throttled(100), "ok"])
    assert result == "ok" and len(timeouts) == 3
    assert 0.25 <= slept[0] <= 0.25 * 1.2 and 0.1 <= slept[1] <= 0.1 * 1.2


def test_the_sdk_gives_up_after_its_retries_or_past_the_timeout() -> None:
    last = throttled()
    result, timeouts, _ = run([throttled(), throttled(), last], retries=2)
    assert result is last and len(timeouts) == 3
    result, timeouts, slept = run([throttled(900), "ok"], timeout=0.5)  # the advice outlasts the call
    assert isinstance(result, Refused) and slept == []
    result, timeouts, slept = run([throttled(100), "ok"], timeout=5.0)
    assert result == "ok" and timeouts[1] == pytest.approx(5.0 - slept[0])  # the deadline left, not a new one


def test_the_sdk_never_retries_other_failures() -> None:
    unavailable = Refused(grpc.StatusCode.UNAVAILABLE, "down", ((RETRY_AFTER_MS, "10"),))
    no_advice = Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "message larger than max")
    for outcome in (unavailable, no_advice):
        result, timeouts, _ = run([outcome, "ok"])
        assert result is outcome and len(timeouts) == 1
