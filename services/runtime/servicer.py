"""Build thin servicers from a service descriptor: decode is done by grpc, we only dispatch.

`delegate(service_descriptor, target, overrides, missing)` makes a servicer whose RPC `Foo` calls
`target.foo(principal, request)`; `overrides` maps RPC names to callables for the few that differ, and
`missing` names the RPCs that knowingly answer UNIMPLEMENTED (and why). Any other RPC without a
handler fails the build, so a method added to a .proto can never ship silently unimplemented.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from services.runtime.context import current_principal
from services.runtime.errors import Unimplemented


class UnmappedRpcError(ValueError, TypeError):
    """delegate() was given a service with an RPC it has no handler for (or a name the service lacks)."""


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def delegate(
    descriptor: Any,
    target: object,
    overrides: dict[str, Callable[..., Any]] | None = None,
    missing: dict[str, str] | None = None,
) -> type:
    """A servicer class for `descriptor` (a ServiceDescriptor); raises UnmappedRpcError when an RPC has
    no handler, or when `overrides`/`missing` name an RPC the service does not have."""
    overrides = overrides or {}
    missing = missing or {}
    rpcs = [method.name for method in descriptor.methods]
    unknown = sorted((set(overrides) | set(missing)) - set(rpcs))
    if unknown:
        raise UnmappedRpcError(f"{descriptor.full_name} has no RPC {', '.join(unknown)}")
    methods: dict[str, Callable[..., Any]] = {}
    for name in rpcs:
        if name in overrides:
            methods[name] = _override(overrides[name])
        elif hasattr(target, snake(name)):
            methods[name] = _as_principal(getattr(target, snake(name)))
        elif name in missing:
            methods[name] = _unimplemented(descriptor.full_name, name, missing[name])
        else:
            raise UnmappedRpcError(
                f"{descriptor.full_name}.{name} has no handler: give {type(target).__name__} a {snake(name)}() "
                "method, an override, or declare it in missing="
            )
    return type(f"{descriptor.name}Servicer", (object,), methods)


def _override(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda self, request, ctx: fn(request, ctx)


def _as_principal(method: Callable[..., Any]) -> Callable[..., Any]:
    return lambda self, request, ctx: method(current_principal(), request)


def _unimplemented(service: str, name: str, why: str) -> Callable[..., Any]:
    def handler(self, request, ctx):
        raise Unimplemented(f"{service}.{name} is not available yet: {why}")

    return handler
