"""`ballast serve dashboard`: the dashboard over HTTPS with the control plane's server certificate.

With BALLAST_PLAINTEXT it serves HTTP, and then, as the gRPC servers do, only on a loopback address.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import uvicorn

from ballast.client import open_channel
from ballast.config import Settings
from ballast.tls import ensure_server_files
from ballast.transport import client_transport, is_loopback
from ballast.v1 import services_pb2_grpc
from services.dashboard.app import build_app
from services.dashboard.reads import Backend, caller_token
from services.runtime.store_client import StoreAuthenticator, anonymous_store, store_over

log = logging.getLogger("ballast.dashboard")


def backend(settings: Settings) -> Backend:
    """Channels to the store and planner that send the current visitor's token (reads.acting_as)."""
    transport = client_transport(settings)
    store = store_over(settings, caller_token)
    fleet = services_pb2_grpc.FleetServiceStub(open_channel(settings.address("planner"), caller_token,
                                                            transport=transport))
    return Backend(store=store, fleet=fleet, authenticate=StoreAuthenticator(anonymous_store(settings)))


def config(settings: Settings) -> uvicorn.Config:
    address = settings.address("dashboard")
    if settings.plaintext and not is_loopback(address):
        raise ValueError(f"dashboard: refusing to serve plaintext HTTP on {address}: with plaintext "
                         "(BALLAST_PLAINTEXT) set, bind a loopback host (BALLAST_HOST=127.0.0.1), or unset it "
                         "for HTTPS")
    host, _, port = address.rpartition(":")
    tls: dict[str, str] = {}
    if not settings.plaintext:
        files = ensure_server_files(settings)
        tls = {"ssl_certfile": str(files.identity.cert), "ssl_keyfile": str(files.identity.key)}
    app = build_app(backend(settings), secure=not settings.plaintext)
    return uvicorn.Config(app, host=host.strip("[]"), port=int(port), log_level="warning", access_log=False,
                          server_header=False, **tls)


@dataclass
class Running:
    """A dashboard serving in a thread of this process (tests, `ballast demo`)."""

    server: uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start(settings: Settings, timeout_s: float = 30.0) -> Running:
    """Serve in a background thread; returns once it listens."""
    server = uvicorn.Server(config(settings))
    thread = threading.Thread(target=server.run, name="dashboard", daemon=True)
    thread.start()
    deadline = threading.Event()
    for _ in range(int(timeout_s * 20)):
        if server.started or not thread.is_alive():
            break
        deadline.wait(0.05)
    if not server.started:
        raise RuntimeError(f"the dashboard did not start on {settings.address('dashboard')}")
    return Running(server, thread, settings.dashboard_url())


def main(settings: Settings) -> int:
    server = uvicorn.Server(config(settings))
    log.info("dashboard on %s", settings.dashboard_url())
    server.run()
    return 0
