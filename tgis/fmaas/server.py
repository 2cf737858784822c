"""The grpc.aio server of TGIS's API, in the HTTP server's process and event loop.

Besides `fmaas.GenerationService` it serves the standard health service (`grpc.health.v1`,
SERVING until shutdown begins) and server reflection, so grpcurl works without the proto. With
TLS files it listens with TLS, and with a client CA it requires client certificates signed by
it (mutual TLS), as TGIS does.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tgis.config import ServeConfig
from tgis.config.types import TlsFiles
from tgis.fmaas import generation_pb2 as pb
from tgis.fmaas import generation_pb2_grpc as pb_grpc
from tgis.fmaas.convert import GrpcLimits
from tgis.fmaas.service import GenerationService
from tgis.server.http.state import ServerState

log = logging.getLogger("tgis.fmaas")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
# Messages bigger than gRPC's 4 MiB default: a batch of long prompts, or of long answers.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def grpc_limits(config: ServeConfig) -> GrpcLimits:
    """The limits the gRPC API applies, from the served configuration."""
    return GrpcLimits.of(
        max_sequence_length=config.max_total_tokens,
        max_new_tokens=config.max_new_tokens or 1024,
        default_include_stop_seqs=config.default_include_stop_seqs,
        output_special_tokens=config.output_special_tokens,
    )


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """TLS credentials; with a client CA, clients must present a certificate it signed."""
    ca = Path(tls.client_ca_cert_path).read_bytes() if tls.client_ca_cert_path else None
    return grpc.ssl_server_credentials(
        [(Path(tls.key_path).read_bytes(), Path(tls.cert_path).read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


class GrpcServer:
    """TGIS's API on `host:port` over the app's ServerState. The grpc.aio server is made in
    `start`, in the event loop that runs it; `port` is the bound one from then on (a free
    one when 0 was asked)."""

    def __init__(self, state: ServerState, host: str, port: int, tls: TlsFiles | None) -> None:
        kind = (
            pb.ModelInfoResponse.ENCODER_DECODER
            if state.info.model_kind == "encoder_decoder"
            else pb.ModelInfoResponse.DECODER_ONLY
        )
        self.service = GenerationService(state, grpc_limits(state.config), kind)
        self.host, self.port, self.tls = host, port, tls
        self.server: grpc.aio.Server | None = None
        self.health: health.aio.HealthServicer | None = None

    async def start(self) -> None:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        pb_grpc.add_GenerationServiceServicer_to_server(self.service, server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            if self.tls is None:
                self.port = server.add_insecure_port(address)
            else:
                self.port = server.add_secure_port(address, server_credentials(self.tls))
        except RuntimeError as exc:  # grpc's "Failed to bind"
            raise OSError(f"cannot listen for gRPC on {address}: {exc}") from None
        await server.start()
        self.server = server
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        secure = " with TLS" if self.tls else ""
        log.info("gRPC (fmaas.GenerationService) on port %d%s", self.port, secure)

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls, give those running `grace_s` to finish, then cancel them."""
        if self.server is None or self.health is None:
            return
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)
        self.server = None


__all__ = ["GrpcServer", "grpc_limits", "server_credentials"]
