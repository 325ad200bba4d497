"""The resolved-token cache (services/runtime/auth.PrincipalCache), on an injected clock."""

from __future__ import annotations

from services.runtime.auth import Principal, PrincipalCache

A = Principal("tnt-a", "team-a")
B = Principal("tnt-b", "team-b")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_token_is_trusted_for_the_ttl_then_resolved_again() -> None:
    clock = Clock()
    cache = PrincipalCache(ttl_s=5.0, clock=clock)
    assert cache.get("tok-a") is None
    cache.put("tok-a", A, cache.stamp())
    clock.now = 4.9
    assert cache.get("tok-a") == A
    clock.now = 5.0
    assert cache.get("tok-a") is None


def test_forget_drops_one_tenant_or_all() -> None:
    cache = PrincipalCache(clock=Clock())
    cache.put("tok-a", A, cache.stamp())
    cache.put("tok-b", B, cache.stamp())
    cache.forget("tnt-a")
    assert cache.get("tok-a") is None and cache.get("tok-b") == B
    cache.forget()
    assert cache.get("tok-b") is None


def test_a_resolution_that_began_before_a_forget_is_not_cached() -> None:
    """A reader that looked the token up before a rotation committed must not bring the old token back."""
    cache = PrincipalCache(clock=Clock())
    stamp = cache.stamp()
    cache.forget("tnt-a")  # the rotation lands while the reader is in the database
    cache.put("tok-a", A, stamp)
    assert cache.get("tok-a") is None


def test_the_cache_stays_bounded() -> None:
    clock = Clock()
    cache = PrincipalCache(ttl_s=1.0, max_entries=3, clock=clock)
    for n in range(3):
        cache.put(f"tok-{n}", A, cache.stamp())
    clock.now = 2.0  # all expired: the next put sweeps them
    cache.put("tok-new", B, cache.stamp())
    assert cache.get("tok-new") == B and len(cache._entries) == 1
    for n in range(5):
        cache.put(f"more-{n}", A, cache.stamp())
    assert len(cache._entries) <= 3
