"""The gRPC servicers of the local and peer APIs: each method unwraps its call for the core.

The same objects answer the frame sockets (:mod:`kvxfer.server.fast_api`, the local fast socket and
the peer frames), which call these methods as gRPC would; nothing else lives here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvxfer.server.core import SidecarCore
from kvxfer.server.peer_auth import ANONYMOUS, PeerCredentials
from kvxfer.wire import local_pb2, peer_pb2

__all__ = ["LocalServicer", "PeerServicer"]

Context = grpc.aio.ServicerContext[Any, Any]


class LocalServicer:
    """Local service methods: unwrap the call and hand it to the core."""

    def __init__(self, core: SidecarCore) -> None:
        self.core = core

    async def register_caches(
        self, req: local_pb2.RegisterCachesRequest, _ctx: Context
    ) -> local_pb2.RegisterCachesResponse:
        return await self.core.register_caches(req)

    async def publish(self, req: local_pb2.PublishRequest, _ctx: Context) -> local_pb2.PublishResponse:
        return await self.core.publish(req)

    async def pull(self, req: local_pb2.PullRequest, ctx: Context) -> local_pb2.PullResponse:
        return await self.core.pull(req, ctx.time_remaining())

    async def prepare(self, req: local_pb2.PrepareRequest, ctx: Context) -> local_pb2.PrepareResponse:
        return await self.core.prepare(req, ctx.time_remaining())

    async def gather_done(self, req: local_pb2.GatherDoneRequest, _ctx: Context) -> local_pb2.PullResponse:
        return await self.core.gather_done(req)

    async def pull_batch(self, req: local_pb2.PullBatchRequest, ctx: Context) -> local_pb2.PullBatchResponse:
        return await self.core.pull_batch(req, ctx.time_remaining())

    def watch_completions(
        self, req: local_pb2.WatchCompletionsRequest, _ctx: Context
    ) -> AsyncIterator[local_pb2.Completion]:
        return self.core.watch(req)

    async def release(self, req: local_pb2.ReleaseRequest, _ctx: Context) -> local_pb2.ReleaseResponse:
        return await self.core.release(req)

    async def abort(self, req: local_pb2.AbortRequest, _ctx: Context) -> local_pb2.AbortResponse:
        return await self.core.abort(req)

    async def drain(self, req: local_pb2.DrainRequest, _ctx: Context) -> local_pb2.DrainResponse:
        return await self.core.drain(float(req.timeout_seconds) or None)

    async def get_status(self, req: local_pb2.GetStatusRequest, _ctx: Context) -> local_pb2.StatusResponse:
        return await self.core.status(req)

    async def expect(self, req: local_pb2.ExpectRequest, _ctx: Context) -> local_pb2.ExpectResponse:
        return await self.core.expect(req)

    async def agent_jobs(self, req: local_pb2.AgentJobsRequest, _ctx: Context) -> local_pb2.AgentJobsResponse:
        return await self.core.agent_jobs(req)

    async def agent_report(self, req: local_pb2.AgentReportRequest, _ctx: Context) -> local_pb2.AgentReportResponse:
        return await self.core.agent_report(req)

    async def stream_step(self, req: local_pb2.StreamStepRequest, _ctx: Context) -> local_pb2.StreamStepResponse:
        return await self.core.stream_step(req)

    async def layer_done(self, req: local_pb2.LayerDoneRequest, _ctx: Context) -> local_pb2.LayerDoneResponse:
        return await self.core.layer_done(req)


class PeerServicer:
    """Peer service methods: each passes on what the caller's credentials prove (see peer_auth)."""

    def __init__(self, core: SidecarCore, *, client_certs: bool) -> None:
        self.core = core
        # Without client certificates (no --tls-ca) a call proves nothing beyond the token: skip
        # building gRPC's auth context on every call.
        self._client_certs = client_certs

    def _creds(self, ctx: Context) -> PeerCredentials:
        return PeerCredentials.of(ctx) if self._client_certs else ANONYMOUS

    async def handshake(self, req: peer_pb2.HandshakeRequest, ctx: Context) -> peer_pb2.HandshakeResponse:
        return await self.core.peer_handshake(req, self._creds(ctx))

    async def get_published(self, req: peer_pb2.GetPublishedRequest, ctx: Context) -> peer_pb2.GetPublishedResponse:
        return await self.core.peer_get_published(req, self._creds(ctx))

    async def get_published_batch(
        self, req: peer_pb2.GetPublishedBatchRequest, ctx: Context
    ) -> peer_pb2.GetPublishedBatchResponse:
        return await self.core.peer_get_published_batch(req, self._creds(ctx))

    async def notify(self, req: peer_pb2.NotifyRequest, ctx: Context) -> peer_pb2.NotifyResponse:
        return await self.core.peer_notify(req, self._creds(ctx))

    async def notify_batch(self, req: peer_pb2.NotifyBatchRequest, ctx: Context) -> peer_pb2.NotifyBatchResponse:
        return await self.core.peer_notify_batch(req, self._creds(ctx))

    async def abort(self, req: peer_pb2.PeerAbortRequest, ctx: Context) -> peer_pb2.PeerAbortResponse:
        return await self.core.peer_abort(req, self._creds(ctx))

    async def hold(self, req: peer_pb2.HoldRequest, ctx: Context) -> peer_pb2.HoldResponse:
        return await self.core.peer_hold(req, self._creds(ctx))

    async def offer(self, req: peer_pb2.OfferRequest, ctx: Context) -> peer_pb2.OfferResponse:
        return await self.core.peer_offer(req, self._creds(ctx))

    async def landed(self, req: peer_pb2.LandedRequest, ctx: Context) -> peer_pb2.LandedResponse:
        return await self.core.peer_landed(req, self._creds(ctx))

    async def revoke(self, req: peer_pb2.RevokeRequest, ctx: Context) -> peer_pb2.RevokeResponse:
        return await self.core.peer_revoke(req, self._creds(ctx))
