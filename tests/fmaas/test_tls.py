"""TLS and mutual TLS on both ports (HTTPS by uvicorn, gRPC by GrpcServer), and the start-up
checks of the TLS flags.

Certificates are made once per module with `cryptography`: a CA, a server certificate for
127.0.0.1 and localhost and a client certificate signed by it, and an unrelated CA with a
client certificate of its own (the stranger, whom mutual TLS must refuse). Servers listen on
127.0.0.1 only, and every network call is bounded by a few seconds.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from starlette.applications import Starlette

from tests.factories import tiny_tokenizer
from tests.server.conftest import make_config
from tests.server.fakes import FakeEngine
from tgis.config import LauncherArgs, ModelFacts, build_serve_config
from tgis.config.types import TlsFiles
from tgis.errors import ConfigError
from tgis.fmaas import generation_pb2 as pb
from tgis.fmaas import generation_pb2_grpc as pb_grpc
from tgis.fmaas.server import GrpcServer
from tgis.server import GracefulServer, ModelInfo, create_app, serve

HOST = "127.0.0.1"
TIMEOUT_S = 5.0  # every HTTP request and gRPC call
START_TIMEOUT_S = 15.0
MAX_TOTAL_TOKENS = 128  # make_config's

# --- certificates ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """A certificate and its private key, as PEM files and bytes."""

    cert_path: Path
    key_path: Path

    @property
    def cert_pem(self) -> bytes:
        return self.cert_path.read_bytes()

    @property
    def key_pem(self) -> bytes:
        return self.key_path.read_bytes()


@dataclass(frozen=True)
class Pki:
    ca: Identity
    server: Identity
    client: Identity
    stranger_ca: Identity
    stranger: Identity


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tgis tests"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _write(
    directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> Identity:
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Identity(cert_path, key_path)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


@dataclass(frozen=True)
class _Ca:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _make_ca(common_name: str) -> _Ca:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    cert = (
        _builder(name, name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _Ca(cert, key)


def _make_leaf(
    ca: _Ca, common_name: str, usage: x509.ObjectIdentifier, san: list[x509.GeneralName] | None
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(_name(common_name), ca.cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )
    if san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(ca.key, hashes.SHA256()), key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = _make_ca("tgis test CA")
    server = _make_leaf(
        ca,
        "tgis test server",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.IPAddress(ipaddress.ip_address(HOST)), x509.DNSName("localhost")],
    )
    client = _make_leaf(ca, "tgis test client", ExtendedKeyUsageOID.CLIENT_AUTH, None)
    stranger_ca = _make_ca("unrelated CA")
    stranger = _make_leaf(stranger_ca, "stranger", ExtendedKeyUsageOID.CLIENT_AUTH, None)
    return Pki(
        ca=_write(directory, "ca", ca.cert, ca.key),
        server=_write(directory, "server", *server),
        client=_write(directory, "client", *client),
        stranger_ca=_write(directory, "stranger-ca", stranger_ca.cert, stranger_ca.key),
        stranger=_write(directory, "stranger", *stranger),
    )


def test_certificates_chain_as_intended(pki: Pki) -> None:
    """The fixtures themselves: what the server tests rely on."""
    ca = x509.load_pem_x509_certificate(pki.ca.cert_pem)
    server = x509.load_pem_x509_certificate(pki.server.cert_pem)
    stranger = x509.load_pem_x509_certificate(pki.stranger.cert_pem)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    server.verify_directly_issued_by(ca)
    x509.load_pem_x509_certificate(pki.client.cert_pem).verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(HOST)]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    with pytest.raises(ValueError):
        stranger.verify_directly_issued_by(ca)
    stranger.verify_directly_issued_by(x509.load_pem_x509_certificate(pki.stranger_ca.cert_pem))


# --- live servers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoints:
    https_url: str
    http_port: int
    grpc_target: str
    server: GracefulServer


def _make_app() -> Starlette:
    tokenizer = tiny_tokenizer()
    config = make_config()
    return create_app(FakeEngine(tokenizer), tokenizer, config, ModelInfo.from_config(config))


@contextmanager
def tls_live_server(app: Starlette, tls: TlsFiles) -> Iterator[Endpoints]:
    """`serve` with `tls` and a GrpcServer companion on free ports of 127.0.0.1, in a thread."""
    servers: list[GracefulServer] = []
    grpc_servers: list[GrpcServer] = []
    errors: list[BaseException] = []

    async def run() -> None:
        # Made in the serving loop (grpc.aio objects belong to the loop that runs them); its
        # `port` is the bound one once it has started.
        grpc_server = GrpcServer(app.state.tgis, HOST, 0, tls)
        grpc_servers.append(grpc_server)
        await serve(
            app,
            HOST,
            0,
            2.0,
            log_level="warning",
            server_ready=servers.append,
            tls=tls,
            companions=[grpc_server],
        )

    def target() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # reported by the waiting test
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True, name="tls-test-server")
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (servers and servers[0].started):
        if errors:
            raise RuntimeError("the TLS test server failed to start") from errors[0]
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the TLS test server did not start")
        time.sleep(0.01)
    server = servers[0]
    port = server.servers[0].sockets[0].getsockname()[1]
    # Companions start before HTTP serves, so the gRPC port is bound by now.
    grpc_port = grpc_servers[0].port
    try:
        assert grpc_port > 0, "the gRPC companion did not report its bound port"
        yield Endpoints(f"https://{HOST}:{port}", port, f"{HOST}:{grpc_port}", server)
    finally:
        server.request_shutdown()
        thread.join(timeout=START_TIMEOUT_S)
    assert not thread.is_alive(), "the TLS test server did not shut down"
    assert not errors, f"the TLS test server failed: {errors[0]!r}"


@pytest.fixture(scope="module")
def tls_server(pki: Pki) -> Iterator[Endpoints]:
    """TLS, no client certificates asked for."""
    tls = TlsFiles(str(pki.server.cert_path), str(pki.server.key_path))
    with tls_live_server(_make_app(), tls) as endpoints:
        yield endpoints


@pytest.fixture(scope="module")
def mtls_server(pki: Pki) -> Iterator[Endpoints]:
    """Mutual TLS: clients must present a certificate signed by the test CA."""
    tls = TlsFiles(str(pki.server.cert_path), str(pki.server.key_path), str(pki.ca.cert_path))
    with tls_live_server(_make_app(), tls) as endpoints:
        yield endpoints


# --- clients --------------------------------------------------------------------------------


def client_context(pki: Pki, identity: Identity | None = None) -> ssl.SSLContext:
    """Trusts the test CA; presents `identity`'s certificate when given."""
    context = ssl.create_default_context(cafile=str(pki.ca.cert_path))
    if identity is not None:
        context.load_cert_chain(str(identity.cert_path), str(identity.key_path))
    return context


def https_get(url: str, context: ssl.SSLContext, **kwargs: Any) -> httpx.Response:
    with httpx.Client(verify=context, timeout=TIMEOUT_S) as client:
        return client.get(url, **kwargs)


def assert_refused(url: str, context: ssl.SSLContext) -> None:
    """The request fails at the transport (handshake failure, alert, reset), not by a timeout."""
    with pytest.raises((httpx.TransportError, ssl.SSLError)) as info:
        https_get(url, context)
    assert not isinstance(info.value, httpx.TimeoutException), repr(info.value)


def model_info(
    target: str,
    credentials: grpc.ChannelCredentials | None,
    options: list[tuple[str, Any]] | None = None,
) -> pb.ModelInfoResponse:
    channel = (
        grpc.insecure_channel(target)
        if credentials is None
        else grpc.secure_channel(target, credentials, options=options)
    )
    with channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        return stub.ModelInfo(pb.ModelInfoRequest(model_id="tiny-llama"), timeout=TIMEOUT_S)


def assert_grpc_refused(target: str, credentials: grpc.ChannelCredentials | None) -> None:
    """The call fails UNAVAILABLE at the connection (past its deadline it would be
    DEADLINE_EXCEEDED)."""
    with pytest.raises(grpc.RpcError) as info:
        model_info(target, credentials)
    code = info.value.code()  # type: ignore[attr-defined]
    assert code == grpc.StatusCode.UNAVAILABLE, (code, info.value)


# --- TLS without client certificates --------------------------------------------------------


def test_https_health_and_info(tls_server: Endpoints, pki: Pki) -> None:
    context = client_context(pki)
    assert https_get(f"{tls_server.https_url}/health", context).status_code == 200
    info = https_get(f"{tls_server.https_url}/info", context)
    assert info.status_code == 200
    assert info.json()["model_id"] == "tiny-llama"


def test_https_certificate_names_localhost(tls_server: Endpoints, pki: Pki) -> None:
    """The server certificate verifies for the DNS name localhost as well as 127.0.0.1."""
    response = https_get(
        f"{tls_server.https_url}/health",
        client_context(pki),
        extensions={"sni_hostname": "localhost"},
    )
    assert response.status_code == 200


def test_https_untrusted_server_is_refused_by_the_client(tls_server: Endpoints) -> None:
    """Without the test CA the client cannot verify the server: the handshake is TLS for real."""
    with pytest.raises(httpx.ConnectError):
        https_get(f"{tls_server.https_url}/health", ssl.create_default_context())


def test_plain_http_to_the_tls_port_fails(tls_server: Endpoints) -> None:
    with pytest.raises(httpx.TransportError) as info:
        httpx.get(f"http://{HOST}:{tls_server.http_port}/health", timeout=TIMEOUT_S)
    assert not isinstance(info.value, httpx.TimeoutException), repr(info.value)


def test_grpc_over_tls(tls_server: Endpoints, pki: Pki) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert_pem)
    response = model_info(tls_server.grpc_target, credentials)
    assert response.max_sequence_length == MAX_TOTAL_TOKENS
    assert response.max_new_tokens > 0


def test_grpc_certificate_names_localhost(tls_server: Endpoints, pki: Pki) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert_pem)
    options = [("grpc.ssl_target_name_override", "localhost")]
    response = model_info(tls_server.grpc_target, credentials, options)
    assert response.max_sequence_length == MAX_TOTAL_TOKENS


def test_grpc_untrusted_server_is_refused_by_the_client(tls_server: Endpoints, pki: Pki) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.stranger_ca.cert_pem)
    assert_grpc_refused(tls_server.grpc_target, credentials)


def test_insecure_grpc_to_the_tls_port_fails(tls_server: Endpoints) -> None:
    assert_grpc_refused(tls_server.grpc_target, None)


# --- mutual TLS -----------------------------------------------------------------------------


def test_mtls_https_with_client_certificate(mtls_server: Endpoints, pki: Pki) -> None:
    context = client_context(pki, pki.client)
    assert https_get(f"{mtls_server.https_url}/health", context).status_code == 200
    assert https_get(f"{mtls_server.https_url}/info", context).json()["model_id"] == "tiny-llama"


def test_mtls_https_without_client_certificate_is_refused(mtls_server: Endpoints, pki: Pki) -> None:
    assert_refused(f"{mtls_server.https_url}/health", client_context(pki))


def test_mtls_https_with_stranger_certificate_is_refused(mtls_server: Endpoints, pki: Pki) -> None:
    assert_refused(f"{mtls_server.https_url}/health", client_context(pki, pki.stranger))


def test_mtls_grpc_with_client_certificate(mtls_server: Endpoints, pki: Pki) -> None:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.cert_pem,
        private_key=pki.client.key_pem,
        certificate_chain=pki.client.cert_pem,
    )
    assert model_info(mtls_server.grpc_target, credentials).max_sequence_length == MAX_TOTAL_TOKENS


def test_mtls_grpc_without_client_certificate_is_refused(mtls_server: Endpoints, pki: Pki) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert_pem)
    assert_grpc_refused(mtls_server.grpc_target, credentials)


def test_mtls_grpc_with_stranger_certificate_is_refused(mtls_server: Endpoints, pki: Pki) -> None:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.cert_pem,
        private_key=pki.stranger.key_pem,
        certificate_chain=pki.stranger.cert_pem,
    )
    assert_grpc_refused(mtls_server.grpc_target, credentials)


def test_mtls_server_still_serves_after_refusals(mtls_server: Endpoints, pki: Pki) -> None:
    """A refused handshake costs the server nothing: a good client is served right after."""
    url = f"{mtls_server.https_url}/health"
    assert_refused(url, client_context(pki))
    assert_refused(url, client_context(pki, pki.stranger))
    assert https_get(url, client_context(pki, pki.client)).status_code == 200


# --- start-up checks of the TLS flags ------------------------------------------------------

GPT2 = ModelFacts("gpt2", 1024)


def build(env: dict[str, str] | None = None, **flags: Any) -> Any:
    return build_serve_config(LauncherArgs(**flags), GPT2, env or {})


def config_error(env: dict[str, str] | None = None, **flags: Any) -> str:
    with pytest.raises(ConfigError) as info:
        build(env, **flags)
    return str(info.value)


def test_config_without_tls_flags_has_no_tls() -> None:
    assert build().tls is None


def test_config_tls_flags(pki: Pki) -> None:
    config = build(
        tls_cert_path=str(pki.server.cert_path),
        tls_key_path=str(pki.server.key_path),
        tls_client_ca_cert_path=str(pki.ca.cert_path),
    )
    assert config.tls == TlsFiles(
        str(pki.server.cert_path), str(pki.server.key_path), str(pki.ca.cert_path)
    )


def test_config_missing_cert_file_names_the_flag(pki: Pki, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    message = config_error(tls_cert_path=str(missing), tls_key_path=str(pki.server.key_path))
    assert "--tls-cert-path" in message
    assert str(missing) in message


def test_config_unreadable_key_names_the_flag(pki: Pki, tmp_path: Path) -> None:
    """A directory where the key should be cannot be read as a file."""
    message = config_error(tls_cert_path=str(pki.server.cert_path), tls_key_path=str(tmp_path))
    assert "--tls-key-path" in message


def test_config_missing_client_ca_names_the_flag(pki: Pki, tmp_path: Path) -> None:
    message = config_error(
        tls_cert_path=str(pki.server.cert_path),
        tls_key_path=str(pki.server.key_path),
        tls_client_ca_cert_path=str(tmp_path / "missing-ca.pem"),
    )
    assert "--tls-client-ca-cert-path" in message


def test_config_key_without_cert_names_the_cert_flag(pki: Pki) -> None:
    assert "--tls-cert-path" in config_error(tls_key_path=str(pki.server.key_path))


def test_config_cert_without_key_names_the_key_flag(pki: Pki) -> None:
    assert "--tls-key-path" in config_error(tls_cert_path=str(pki.server.cert_path))


def test_config_client_ca_alone_is_refused(pki: Pki) -> None:
    message = config_error(tls_client_ca_cert_path=str(pki.ca.cert_path))
    assert "--tls-cert-path" in message


def test_config_tls_from_the_environment(pki: Pki) -> None:
    env = {"TLS_CERT_PATH": str(pki.server.cert_path), "TLS_KEY_PATH": str(pki.server.key_path)}
    config = build(env)
    assert config.tls is not None
    assert config.tls.cert_path == str(pki.server.cert_path)
    assert config.tls.key_path == str(pki.server.key_path)
    assert config.tls.client_ca_cert_path is None
    env["TLS_CLIENT_CA_CERT_PATH"] = str(pki.ca.cert_path)
    assert build(env).tls == TlsFiles(
        str(pki.server.cert_path), str(pki.server.key_path), str(pki.ca.cert_path)
    )


def test_config_missing_file_from_the_environment_names_the_variable(
    pki: Pki, tmp_path: Path
) -> None:
    missing = str(tmp_path / "missing.pem")
    message = config_error({"TLS_CERT_PATH": missing, "TLS_KEY_PATH": str(pki.server.key_path)})
    assert f"TLS_CERT_PATH={missing}" in message
    assert "--tls-cert-path" in message  # the hint names the flag too


def test_config_flag_overrides_the_environment(pki: Pki, tmp_path: Path) -> None:
    env = {"TLS_CERT_PATH": str(tmp_path / "missing.pem"), "TLS_KEY_PATH": str(pki.server.key_path)}
    config = build(env, tls_cert_path=str(pki.server.cert_path))
    assert config.tls is not None
    assert config.tls.cert_path == str(pki.server.cert_path)


def test_config_refuses_a_certificate_that_is_not_pem(pki: Pki, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    message = config_error(tls_cert_path=str(garbage), tls_key_path=str(pki.server.key_path))
    assert "--tls-cert-path" in message and "not a PEM certificate and its private key" in message


def test_config_refuses_a_key_of_another_certificate(pki: Pki) -> None:
    message = config_error(
        tls_cert_path=str(pki.server.cert_path), tls_key_path=str(pki.client.key_path)
    )
    assert "--tls-key-path" in message and "not a PEM certificate and its private key" in message


def test_config_refuses_a_client_ca_that_is_not_pem(pki: Pki, tmp_path: Path) -> None:
    garbage = tmp_path / "ca.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
    message = config_error(
        tls_cert_path=str(pki.server.cert_path),
        tls_key_path=str(pki.server.key_path),
        tls_client_ca_cert_path=str(garbage),
    )
    assert "--tls-client-ca-cert-path" in message and "not PEM CA certificates" in message
