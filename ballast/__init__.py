"""Ballast: a training control plane for shared GPU fleets. Client SDK, CLI and generated contracts."""

__version__ = "0.1.0"
