"""The writer's side of a push's end: the peer ``Landed`` notice that tells a reader how the push of
its offer ended (done, with what moved, or failed), and the words a failure gets when a WRITE of
the offer may still land in the reader's blocks."""

from __future__ import annotations

from kvxfer.config import Settings
from kvxfer.errors import KvxferError, Reason
from kvxfer.logs import get_logger, log_context
from kvxfer.server.outbox import PEER_CALL_SECONDS, Outbox
from kvxfer.server.peers import PeerDirectory
from kvxfer.server.registration import Registry
from kvxfer.server.state import Offer
from kvxfer.wire import peer_pb2
from kvxfer.wire.convert import rank_to_proto
from kvxfer.wire.status import code_of

__all__ = ["UNFENCED_WRITE", "LandedNotices", "amend_unfenced"]

log = get_logger("kvxfer.server")
#: Added to the message of a push that ended while a WRITE of it was unfenced.
UNFENCED_WRITE = (
    "; a WRITE into it was still in flight after the fence budget, so its bytes may still land in the blocks"
)


class LandedNotices:
    """Sends the ``Landed`` notices of the offers this sidecar holds as a writer."""

    def __init__(self, settings: Settings, registry: Registry, peers: PeerDirectory, outbox: Outbox) -> None:
        self.settings = settings
        self.registry = registry
        self.peers = peers
        self.outbox = outbox

    def send(self, offer: Offer, err: KvxferError | None, moved: tuple[int, int, float] = (0, 0, 0.0)) -> None:
        """Tell ``offer``'s reader how its push ended: done (``err`` None; ``moved`` is bytes, descriptors,
        data-plane seconds) or failed with ``err``. The call runs in the background, in the outbox."""
        me = self.registry.registration
        req = peer_pb2.LandedRequest(
            request_id=offer.request_id, engine_id=self.settings.engine_id, instance_id=self.registry.instance_id,
            rank=rank_to_proto(me.rank) if me is not None else None, epoch=offer.reader.epoch,
            bytes=moved[0], descriptors=moved[1], data_seconds=moved[2],
        )  # fmt: skip
        if err is not None:
            req.code, req.message, req.reason = code_of(err).value[0], err.message, err.reason.value
        self.outbox.spawn(self._call(offer, req))

    async def _call(self, offer: Offer, req: peer_pb2.LandedRequest) -> None:
        address = offer.reader.address
        try:
            await self.peers.call(address, "Landed", lambda s: s.Landed(req, timeout=PEER_CALL_SECONDS,
                                                                        metadata=self.peers.metadata))  # fmt: skip
        except KvxferError as exc:  # the reader's own deadline ends its pull
            with log_context(request_id=offer.request_id, peer=offer.reader.label):
                log.warning("could not tell a reader its push landed", extra={"error": exc.message})


def amend_unfenced(err: KvxferError) -> None:
    """Make a push's failure say that a WRITE of it may still land (reason DATA_PLANE_UNFENCED; same class)."""
    if err.reason != Reason.DATA_PLANE_UNFENCED:
        err.message += UNFENCED_WRITE
        err.args = (err.message, *err.args[1:])
        err.reason = Reason.DATA_PLANE_UNFENCED
