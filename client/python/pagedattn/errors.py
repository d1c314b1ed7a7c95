"""The one exception type of the package: every failure, from the server, the transport or the
client's own argument checks, is a PagedAttnError carrying a gRPC status code."""

import grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class PagedAttnError(Exception):
    """A failed call. `code` is a grpc.StatusCode (see the contract in pagedattn.proto: e.g.
    NOT_FOUND for an unknown sequence, RESOURCE_EXHAUSTED when the pool is full); `message` the
    server's or the client's explanation. The server changes nothing on an error, and a request
    the client refuses (INVALID_ARGUMENT before sending) is never sent."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def invalid_argument(message: str) -> PagedAttnError:
    return PagedAttnError(grpc.StatusCode.INVALID_ARGUMENT, message)


def from_rpc_error(error: grpc.RpcError) -> PagedAttnError:
    """A grpc.RpcError (sync) or grpc.aio.AioRpcError -> PagedAttnError, code for code."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    return PagedAttnError(code or grpc.StatusCode.UNKNOWN, details or "")


def from_code(value: int, message: str) -> PagedAttnError:
    """A google.rpc.Code number (DecodeResponse.error_code) -> PagedAttnError."""
    return PagedAttnError(_CODES.get(value, grpc.StatusCode.UNKNOWN), message)
