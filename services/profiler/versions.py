"""What measured a profile: one string for storing and for cache lookups, computed without importing
torch (the profiler service looks profiles up; only its worker processes import torch)."""

from __future__ import annotations

from importlib import metadata


def software() -> str:
    """"torch 2.13.0, ballast 0.1.0": a torch or ballast upgrade misses the cache and re-profiles."""

    def version(package: str) -> str:
        try:
            return metadata.version(package).split("+")[0]
        except metadata.PackageNotFoundError:
            return "unknown"

    return f"torch {version('torch')}, ballast {version('ballast')}"
