"""gRPC credentials from settings: TLS everywhere, mutual TLS on the planner's agent port, plaintext only when
asked for (BALLAST_PLAINTEXT) and then on loopback only (the server refuses any other bind)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import grpc

from ballast.config import Settings
from ballast.tls import Identity, TlsError, agent_identity, ensure_server_files, tls_files


@dataclass(frozen=True)
class ClientTransport:
    """What a channel needs: the CA to verify servers with (None: plaintext) and an optional client identity."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.ca is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


PLAINTEXT = ClientTransport()


def client_transport(settings: Settings, identity: Identity | None = None) -> ClientTransport:
    """TLS verified against the configured CA (with `identity` as client certificate), or plaintext."""
    if settings.plaintext:
        return PLAINTEXT
    ca = tls_files(settings).ca
    if not ca.exists():
        raise TlsError(f"tls_ca: no CA certificate at {ca}; set BALLAST_TLS_CA to the CA that signed the servers' "
                       "certificates (embedded: run `ballast up` with this data dir first), or set "
                       "BALLAST_PLAINTEXT=1 for a plaintext control plane on loopback")
    if identity is None:
        return ClientTransport(ca.read_bytes())
    return ClientTransport(ca.read_bytes(), identity.cert.read_bytes(), identity.key.read_bytes())


def agent_transport(settings: Settings, name: str) -> ClientTransport:
    """An executor agent's channel to the planner: its client certificate proves which host it is."""
    if settings.plaintext:
        return PLAINTEXT
    return client_transport(settings, agent_identity(settings, name))


def server_credentials(settings: Settings, require_client_auth: bool = False) -> grpc.ServerCredentials | None:
    """This server's TLS credentials (None: plaintext); with `require_client_auth` a client must present a
    certificate the CA signed (the planner's agent port)."""
    if settings.plaintext:
        return None
    files = ensure_server_files(settings)
    pair = (files.identity.key.read_bytes(), files.identity.cert.read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=files.ca.read_bytes(),
                                       require_client_auth=require_client_auth)


def peer_common_name(context: grpc.ServicerContext) -> str:
    """The CN of the client certificate the peer presented and the CA verified ("" when none)."""
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode() if names else ""


def is_loopback(address: str) -> bool:
    """True for localhost / 127.x / ::1 host:port addresses (a wildcard or a name of this host is not)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
