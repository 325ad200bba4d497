"""Refused authentications, per peer address: limited (a token bucket of failures, so guessing tokens costs time)
and audited (aggregated, so a flood cannot fill the audit log).

A peer whose bucket of failures is empty is refused with RESOURCE_EXHAUSTED before its token is even looked
at, until the bucket refills, unless that token authenticated lately (the services' own tokens, a user who made
a few mistakes behind the same address): a flood of bad tokens neither reaches the store nor locks them out.
The first refusal from a peer in each AUDIT_WINDOW_S writes one audit row that says how many refusals that
peer had since its last row (a state-changing call refused for its token keeps its own row, as before; one
held back here has none).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ballast.config import Settings
from services.runtime.auth import hash_token
from services.runtime.errors import ResourceExhausted

FAILURE_RATE = 2.0  # failed authentications a second a peer may keep making ...
FAILURE_BURST = 30  # ... after this many at once
AUDIT_WINDOW_S = 60.0
MAX_PEERS = 10_000  # peers remembered (the least recently refused are forgotten first)
GOOD_TOKENS = 10_000  # tokens that authenticated lately, by hash, let through a blocked address


def peer_address(peer: str) -> str:
    """A gRPC peer ("ipv4:10.0.0.5:51234", "ipv6:[::1]:51234", "unix:/run/x") without its port."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return f"{kind}:{rest.rsplit(':', 1)[0]}"
    return peer


class TooManyFailures(ResourceExhausted):
    def __init__(self, address: str, retry_after_s: float):
        super().__init__(f"too many failed authentications from {address}; retry in "
                         f"{max(1, math.ceil(retry_after_s))} s",
                         fix="send a valid 'authorization: Bearer <token>' (ask the platform admin for one)")


@dataclass
class _Peer:
    tokens: float  # failures this peer may still make now
    stamp: float
    unaudited: int = 0
    audited_at: float = -math.inf


class AuthFailures:
    """Thread-safe; `audit(address, refusals)` writes one aggregated row (the interceptor's audit log)."""

    def __init__(self, rate: float = FAILURE_RATE, burst: int = FAILURE_BURST,
                 clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._good: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, settings: Settings | None) -> AuthFailures:
        if settings is None:
            return cls()
        return cls(settings.auth_failure_rate, settings.auth_failure_burst)

    def check(self, peer: str, token: str) -> None:
        """Raise TooManyFailures while `peer`'s address has no failure left to spend, unless `token` is good."""
        address = peer_address(peer)
        with self._lock:
            known = self._peers.get(address)
            if self.rate <= 0 or known is None or (token and hash_token(token) in self._good):
                return
            self._refill(known, self.clock())
            if known.tokens < 1.0:
                raise TooManyFailures(address, (1.0 - known.tokens) / self.rate)

    def succeeded(self, token: str) -> None:
        digest = hash_token(token)
        with self._lock:
            self._good[digest] = None
            self._good.move_to_end(digest)
            while len(self._good) > GOOD_TOKENS:
                self._good.popitem(last=False)

    def refused(self, peer: str, aggregate: bool = True) -> int:
        """Spend a failure of `peer`'s; returns how many refusals to audit now in one row (0: not yet). A refusal
        with a row of its own (a state-changing call's) is not `aggregate`d."""
        address = peer_address(peer)
        with self._lock:
            now = self.clock()
            known = self._peers.pop(address, None) or _Peer(float(self.burst), now)
            self._peers[address] = known  # most recently refused last
            while len(self._peers) > MAX_PEERS:
                self._peers.popitem(last=False)
            self._refill(known, now)
            known.tokens = max(0.0, known.tokens - 1.0)
            known.unaudited += int(aggregate)
            if not known.unaudited or now - known.audited_at < AUDIT_WINDOW_S:
                return 0
            count, known.unaudited, known.audited_at = known.unaudited, 0, now
            return count

    def _refill(self, known: _Peer, now: float) -> None:
        if now > known.stamp:
            known.tokens = min(float(self.burst), known.tokens + (now - known.stamp) * self.rate)
            known.stamp = now
