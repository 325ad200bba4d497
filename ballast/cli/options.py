"""Option vocabularies shared by `ballast plan`, `submit` and `profile`: engines, schedules, precisions, sizes.

They are the SDK's (ballast/sdk.py), so flags and `Client` arguments mean the same; the subcommands import them
from here without importing each other.
"""

from __future__ import annotations

from ballast.sdk import DTYPES, ENGINES, SCHEDULES, UNITS, parse_bytes

__all__ = ["DTYPES", "ENGINES", "SCHEDULES", "UNITS", "parse_bytes"]
