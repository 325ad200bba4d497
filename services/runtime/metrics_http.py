"""The metrics endpoint: this process's Prometheus registry on its own port.

Each process has its metrics port (`BALLAST_<SERVICE>_METRICS_PORT`; 0 turns it off). It is HTTPS with the
servers' certificate and serves only a client presenting a certificate of the plane's CA (a Prometheus with its
own, or the data dir's tls/scraper.crt: ballast.tls.scraper_identity), so what the metrics say of tenants stays
with the operator. A plaintext plane binds loopback only, as for gRPC, and its planner names no tenant.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.registry import Collector

from ballast.config import Settings
from ballast.tls import ensure_server_files, scraper_identity
from ballast.transport import is_loopback

log = logging.getLogger("ballast.metrics")
_collectors: dict[str, Collector] = {}


def register_collector(key: str, collector: Collector) -> Callable[[], None]:
    """Add a scrape-time collector to this process's registry, replacing the last one under `key` (a process
    serves one store and one planner; a test may start another before the first is gone). Returns how to
    remove it again (a no-op once replaced)."""
    previous = _collectors.pop(key, None)
    if previous is not None:
        REGISTRY.unregister(previous)
    REGISTRY.register(collector)
    _collectors[key] = collector

    def remove() -> None:
        if _collectors.get(key) is collector:
            REGISTRY.unregister(_collectors.pop(key))

    return remove


def serve_metrics(settings: Settings, port: int, what: str) -> Callable[[], None]:
    """Serve this process's metrics on `port` (0: not at all); returns how to stop serving."""
    if port <= 0:
        return lambda: None
    host = settings.host if settings.host not in ("", "::") else "0.0.0.0"
    if settings.plaintext:
        if not is_loopback(f"{host}:{port}"):
            raise ValueError(f"{what}: refusing to serve metrics over plain HTTP on {host}: with plaintext set, "
                             "bind a loopback host (BALLAST_HOST=127.0.0.1)")
        server, thread = start_http_server(port, addr=host, registry=REGISTRY)
    else:
        files = ensure_server_files(settings)
        scraper_identity(settings)  # the local CA issues the scraper's certificate beside the servers'
        server, thread = start_http_server(port, addr=host, registry=REGISTRY, certfile=str(files.identity.cert),
                                           keyfile=str(files.identity.key), client_cafile=str(files.ca),
                                           client_auth_required=True)
    log.info("metrics", extra={"server": what, "url": metrics_url(settings, port)})

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop


def metrics_url(settings: Settings, port: int) -> str:
    scheme = "http" if settings.plaintext else "https"
    host = settings.advertised_host() if settings.host in ("", "0.0.0.0", "::") else settings.host
    return f"{scheme}://{host}:{port}/metrics"
