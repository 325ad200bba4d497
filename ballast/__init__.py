"""Ballast: a training control plane for shared GPU fleets. Client SDK, CLI and generated contracts.

`from ballast import Client` is the SDK (docs/sdk.md); it is imported on first use, so that the CLI and the
services, which import `ballast.config` and the contracts, do not pay for gRPC channels they never open.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ballast.client import Client

__version__ = "0.1.0"
__all__ = ["Client", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from ballast.client import Client

        return Client
    raise AttributeError(f"module 'ballast' has no attribute {name!r}")
