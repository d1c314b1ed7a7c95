"""Connection options of Client and AsyncClient, with the C++ client's semantics
(client/client.h ClientOptions): raised message limits, a per-call deadline, optional TLS and
mutual TLS from PEM files, and a bearer token sent on every call."""

import dataclasses
from typing import Optional

import grpc

from .errors import invalid_argument


@dataclasses.dataclass(frozen=True)
class ClientOptions:
    # Any gRPC target: "host:port", "dns:///name:port", "unix:/path".
    target: str = "127.0.0.1:50051"
    # Send and receive limit in bytes; keep it >= the server's --max_message_bytes.
    max_message_bytes: int = 64 << 20
    # Deadline of each unary call in seconds; None or <= 0: none. Streams have no deadline.
    timeout: Optional[float] = 60.0
    # HTTP/2 stream window this client grants (bytes, fixed, no BDP probing); 0: gRPC's default.
    http2_window_bytes: int = 0
    # Largest HTTP/2 frame this client accepts; 0: gRPC's 16 KiB.
    http2_max_frame_bytes: int = 0
    # A TCP connection of this client's own instead of the process-wide shared one.
    own_connection: bool = False
    # Wait for the channel to connect instead of failing fast with UNAVAILABLE.
    wait_for_ready: bool = False
    # TLS: on when `tls` is set or any tls_*_file is given. The server is verified against
    # tls_ca_file (PEM; empty: the system's roots); tls_cert_file + tls_key_file (PEM) are the
    # client certificate for a server that requires mutual TLS.
    tls: bool = False
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # Overrides the name the server certificate is checked against (default: the target's host).
    tls_server_name: str = ""
    # Sent on every call as "authorization: Bearer <token>" when not empty.
    bearer_token: str = ""

    def validate(self) -> None:
        """INVALID_ARGUMENT (PagedAttnError) for an empty target, a message limit outside
        [1 KiB, 2 GiB), or only one of tls_cert_file/tls_key_file."""
        if not self.target:
            raise invalid_argument("empty target")
        if not 1024 <= self.max_message_bytes < 2**31:
            raise invalid_argument(
                f"max_message_bytes must be in [1024, 2^31), got {self.max_message_bytes}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise invalid_argument("a client certificate needs its key (and the other way round)")

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls or self.tls_ca_file or self.tls_cert_file or self.tls_key_file)

    def channel_arguments(self):
        args = [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes)]
        if self.tls_server_name:
            args.append(("grpc.ssl_target_name_override", self.tls_server_name))
        if self.http2_window_bytes > 0:
            args += [("grpc.http2.lookahead_bytes", self.http2_window_bytes),
                     ("grpc.http2.bdp_probe", 0)]
        if self.http2_max_frame_bytes > 0:
            args.append(("grpc.http2.max_frame_size", self.http2_max_frame_bytes))
        if self.own_connection:
            args.append(("grpc.use_local_subchannel_pool", 1))
        return args

    def credentials(self) -> Optional[grpc.ChannelCredentials]:
        """TLS credentials with the PEM files read now, or None for plaintext."""
        if not self.uses_tls:
            return None
        pems = []
        for path in (self.tls_ca_file, self.tls_cert_file, self.tls_key_file):
            if not path:
                pems.append(None)
                continue
            try:
                with open(path, "rb") as f:
                    pems.append(f.read())
            except OSError as e:
                raise invalid_argument(f"cannot read {path}: {e.strerror}") from None
        return grpc.ssl_channel_credentials(
            root_certificates=pems[0], private_key=pems[2], certificate_chain=pems[1])

    def metadata(self):
        return (("authorization", f"Bearer {self.bearer_token}"),) if self.bearer_token else None

    def deadline(self) -> Optional[float]:
        return self.timeout if self.timeout is not None and self.timeout > 0 else None


def make_options(target, options: Optional[ClientOptions], overrides) -> ClientOptions:
    """Client(target, options=..., **fields): fields override `options`, `target` overrides
    both; the result is validated."""
    base = options if options is not None else ClientOptions()
    try:
        merged = dataclasses.replace(base, **overrides)
    except TypeError as e:
        raise invalid_argument(str(e)) from None
    if target is not None:
        merged = dataclasses.replace(merged, target=target)
    merged.validate()
    return merged
