"""Option vocabularies shared by `ballast plan`, `submit` and `profile`: engines, schedules, precisions, sizes; and
how a command reports a call the control plane refused.

They are the SDK's (ballast/sdk.py), so flags and `Client` arguments mean the same; the subcommands import them
from here without importing each other.
"""

from __future__ import annotations

import grpc
from rich.console import Console
from rich.markup import escape

from ballast.sdk import DTYPES, ENGINES, SCHEDULES, UNITS, parse_bytes

__all__ = ["DTYPES", "ENGINES", "SCHEDULES", "UNITS", "parse_bytes", "refused"]
_err = Console(stderr=True)


def refused(exc: grpc.RpcError) -> int:
    """One line on stderr, the status and the server's words (field and fix included); exit status 1."""
    _err.print(f"[red]error[/red] {exc.code().name}: {escape(exc.details() or '')}")
    return 1
