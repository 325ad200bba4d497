"""The Store interface in-process: a Repository bound to one principal, no gRPC in between.

For tests and tools that want the services' logic over a real database without a store server; the
repository raises the same domain errors RemoteStore re-raises, so callers cannot tell the two apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.runtime.auth import Principal
from services.runtime.servicer import snake
from services.runtime.store_api import Store, implement
from services.store.repository import Repository


def _dispatch(name: str) -> Callable[..., Any]:
    method = snake(name)
    return lambda self, request: getattr(self.repo, method)(self.principal, request)


@implement(_dispatch)
class LocalStore(Store):
    """Every call runs as `principal`, exactly as the store servicer runs a call from that caller."""

    def __init__(self, repo: Repository, principal: Principal):
        self.repo = repo
        self.principal = principal
