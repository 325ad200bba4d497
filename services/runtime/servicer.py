"""Build thin servicers from a service descriptor: decode is done by grpc, we only dispatch.

`delegate(service_descriptor, target, overrides)` makes a servicer whose RPC `Foo` calls
`target.foo(principal, request)`; `overrides` maps RPC names to callables for the few that differ.
RPCs with no target method answer UNIMPLEMENTED naming the issue that will provide them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from services.runtime.context import current_principal
from services.runtime.errors import Unimplemented


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def delegate(
    descriptor: Any,
    target: object,
    overrides: dict[str, Callable[..., Any]] | None = None,
    missing: dict[str, str] | None = None,
) -> type:
    """A servicer class for `descriptor` (a ServiceDescriptor)."""
    overrides = overrides or {}
    missing = missing or {}
    methods: dict[str, Callable[..., Any]] = {}
    for method in descriptor.methods:
        name = method.name
        if name in overrides:
            methods[name] = _override(overrides[name])
        elif hasattr(target, snake(name)):
            methods[name] = _as_principal(getattr(target, snake(name)))
        else:
            methods[name] = _unimplemented(descriptor.full_name, name, missing.get(name, "not implemented yet"))
    return type(f"{descriptor.name}Servicer", (object,), methods)


def _override(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda self, request, ctx: fn(request, ctx)


def _as_principal(method: Callable[..., Any]) -> Callable[..., Any]:
    return lambda self, request, ctx: method(current_principal(), request)


def _unimplemented(service: str, name: str, why: str) -> Callable[..., Any]:
    def handler(self, request, ctx):
        raise Unimplemented(f"{service}.{name} is not available yet: {why}")

    return handler
