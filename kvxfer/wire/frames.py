"""The local fast socket's format: length-prefixed protobuf frames for a worker's hot calls.

A worker's ``Pull``, ``PullBatch``, ``Publish``, ``Expect`` and ``Prepare`` (and the layer-wise push's
``StreamStep`` and ``LayerDone``; with ``--backend worker``, its agent's ``AgentJobs`` and
``AgentReport``) may go to its sidecar as frames on a Unix
stream socket beside the local API's (:func:`fast_socket_path`) instead of as gRPC calls: the same
request and response messages (``kvxfer.v1``), a fixed header instead of HTTP/2. Measured on two
cores (``bench/local_hop.py``), a Pull round trip costs ~60 µs this way from the blocking client's
thread against ~540 µs over grpc.aio. Every other call stays on gRPC, which remains the fallback.

A connection opens with a hello (:data:`HELLO`: the magic line and the bearer token, if any) and
its answer; then, in either order and with any number in flight:

* a request: :data:`REQUEST` (payload length, call id, method, timeout in seconds; 0: none) then the
  serialized request message. Method :data:`CANCEL` (no payload, no answer) abandons a call, as a
  gRPC client's cancellation or passed deadline does;
* an answer: :data:`ANSWER` (payload length, call id, status code) then, for code 0, the response
  message, else a serialized ``google.rpc.Status`` holding the same ``ErrorInfo`` (reason, field)
  a failed gRPC call carries (:func:`kvxfer.wire.status.status_message`). A *quiet* method
  (:attr:`FastMethod.quiet`: ``Expect`` as method 11) is answered only when it fails; its caller
  does not wait, and hears of a failure by the answer to its call id.

All integers are little-endian. The client is :mod:`kvxfer.fastsock`, the sidecar's side
:mod:`kvxfer.server.fast_api`.

Between sidecars the same framing carries the peer API's hot calls (:data:`PEER_METHODS`: a pull's
lookup and its completion notice, the holds of queued requests) on a TCP connection to the address a
peer's handshake names (``PeerInfo.frames_address``), under TLS when the peer API has TLS, opened by
:data:`PEER_HELLO`. A grpc.aio call costs ~0.9 ms of CPU on each side of a two-core host, frames
~0.08 ms; the handshake, aborts and push calls stay on gRPC.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from google.protobuf.message import Message

from kvxfer.wire import local_pb2, peer_pb2

__all__ = [
    "ANSWER",
    "CANCEL",
    "FAST_SOCKET_SUFFIX",
    "HELLO",
    "HELLO_CALL",
    "METHODS",
    "METHOD_OF_REQUEST",
    "PEER_HELLO",
    "PEER_METHODS",
    "QUIET_METHOD_OF_REQUEST",
    "REQUEST",
    "FastMethod",
    "fast_socket_path",
]

#: Appended to the local API's socket path to name the fast socket next to it.
FAST_SOCKET_SUFFIX = ".fast"
#: First bytes of a connection's hello frame (the token follows); a new format gets a new line.
HELLO = b"kvxfer-frames/1\n"
#: Call id of the hello and its answer.
HELLO_CALL = 0
#: Method of a frame that abandons the call of its id.
CANCEL = 255
#: Request header: payload length, call id, method, timeout seconds (0: none).
REQUEST = struct.Struct("<IIBd")
#: Answer header: payload length, call id, status code (0: OK).
ANSWER = struct.Struct("<IIB")


class FastMethod:
    """One RPC of ``kvxfer.v1.Local`` that the fast socket carries: its number and message types.

    ``quiet``: this number runs the RPC but answers only when it fails (the caller does not wait; see
    :data:`QUIET_METHOD_OF_REQUEST`).
    """

    def __init__(
        self, number: int, name: str, request: type[Message], response: type[Message], *, quiet: bool = False
    ) -> None:
        self.number = number
        self.name = name
        self.request = request
        self.response = response
        self.quiet = quiet


def _by_number(*methods: FastMethod) -> dict[int, FastMethod]:
    table = {m.number: m for m in methods}
    assert len(table) == len(methods), "a method number given twice"
    return table


#: The hot calls, by the number their frames carry. Numbers are never reused.
METHODS: dict[int, FastMethod] = _by_number(
    FastMethod(1, "Pull", local_pb2.PullRequest, local_pb2.PullResponse),
    FastMethod(2, "PullBatch", local_pb2.PullBatchRequest, local_pb2.PullBatchResponse),
    FastMethod(3, "Publish", local_pb2.PublishRequest, local_pb2.PublishResponse),
    FastMethod(4, "AgentJobs", local_pb2.AgentJobsRequest, local_pb2.AgentJobsResponse),
    FastMethod(5, "AgentReport", local_pb2.AgentReportRequest, local_pb2.AgentReportResponse),
    FastMethod(6, "StreamStep", local_pb2.StreamStepRequest, local_pb2.StreamStepResponse),
    FastMethod(7, "LayerDone", local_pb2.LayerDoneRequest, local_pb2.LayerDoneResponse),
    # One per decode request, from the vLLM scheduler as the request enters its queue.
    FastMethod(8, "Expect", local_pb2.ExpectRequest, local_pb2.ExpectResponse),
    # A worker's report on a pull whose bytes it moved itself (PullRequest.worker_gather).
    FastMethod(9, "GatherDone", local_pb2.GatherDoneRequest, local_pb2.PullResponse),
    # The Pull a worker is about to send, from the vLLM scheduler as it allocates the request's blocks.
    FastMethod(10, "Prepare", local_pb2.PrepareRequest, local_pb2.PrepareResponse),
    # Expect, answered only when it fails: the vLLM scheduler does not wait for an Expect, so its
    # success costs neither side an answer (a write, a wake-up, a parse).
    FastMethod(11, "Expect", local_pb2.ExpectRequest, local_pb2.ExpectResponse, quiet=True),
)
#: The method a request message type is sent as (a call that waits for its answer).
METHOD_OF_REQUEST: dict[type[Message], FastMethod] = {m.request: m for m in METHODS.values() if not m.quiet}
#: The method a request message type is sent as when its caller does not wait: answered only on failure.
QUIET_METHOD_OF_REQUEST: dict[type[Message], FastMethod] = {m.request: m for m in METHODS.values() if m.quiet}

#: First bytes of a peer connection's hello (the bearer token follows, if the cluster has one).
PEER_HELLO = b"kvxfer-peer-frames/1\n"
#: The peer API's hot calls (``kvxfer.v1.Peer``), by number. Numbers are never reused.
PEER_METHODS: dict[int, FastMethod] = _by_number(
    FastMethod(1, "GetPublished", peer_pb2.GetPublishedRequest, peer_pb2.GetPublishedResponse),
    FastMethod(2, "GetPublishedBatch", peer_pb2.GetPublishedBatchRequest, peer_pb2.GetPublishedBatchResponse),
    FastMethod(3, "Notify", peer_pb2.NotifyRequest, peer_pb2.NotifyResponse),
    FastMethod(4, "NotifyBatch", peer_pb2.NotifyBatchRequest, peer_pb2.NotifyBatchResponse),
    FastMethod(5, "Hold", peer_pb2.HoldRequest, peer_pb2.HoldResponse),
)


def fast_socket_path(local_socket: str | os.PathLike[str]) -> Path:
    """The fast socket that sits beside a sidecar's local API socket (``unix://`` prefix allowed)."""
    p = Path(os.fspath(local_socket).removeprefix("unix://").removeprefix("unix:"))
    return p.with_name(p.name + FAST_SOCKET_SUFFIX)
