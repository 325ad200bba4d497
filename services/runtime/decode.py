"""Requests are parsed inside the handler, so a malformed one is the caller's mistake: INVALID_ARGUMENT naming
the message. Left to grpc, a failed parse (garbage bytes, nesting past protobuf's recursion limit) answers
INTERNAL "Exception deserializing request!", which reads as the service's fault."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from services.runtime.errors import InvalidArgument
from services.runtime.interceptors import PUBLIC_PREFIXES, abort_for

_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


class DecodeInterceptor(grpc.ServerInterceptor):
    """The outermost interceptor: hands grpc an identity deserializer and parses in the call's own thread."""

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None or details.method.startswith(PUBLIC_PREFIXES):
            return handler  # health and reflection are grpc's own (the health Watch must stay non-blocking)
        parse, method = handler.request_deserializer, details.method

        def decode(data: bytes, ctx: grpc.ServicerContext) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # noqa: BLE001 - DecodeError, RecursionError: the bytes are the caller's
                abort_for(InvalidArgument(f"not a valid request message for {method} ({type(exc).__name__}: {exc})",
                                          field="request",
                                          fix="send the message its .proto defines, serialized by a protobuf library"),
                          ctx)

        for kind, factory in _KINDS:
            behavior = getattr(handler, kind)
            if behavior is not None:
                return factory(_decoding(behavior, decode, handler.request_streaming), request_deserializer=None,
                               response_serializer=handler.response_serializer)
        return handler


def _decoding(behavior: Callable[..., Any], decode: Callable[[bytes, grpc.ServicerContext], Any],
              streaming_in: bool) -> Callable[..., Any]:
    if streaming_in:
        def streamed(requests: Iterator[bytes], ctx: grpc.ServicerContext) -> Any:
            return behavior((decode(data, ctx) for data in requests), ctx)
        return streamed

    def unary(data: bytes, ctx: grpc.ServicerContext) -> Any:
        return behavior(decode(data, ctx), ctx)
    return unary
