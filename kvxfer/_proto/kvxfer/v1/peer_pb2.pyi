from kvxfer._proto.kvxfer.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GroupLayout(_message.Message):
    __slots__ = ("name", "layout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    layout: _common_pb2.Layout
    def __init__(self, name: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ...) -> None: ...

class DataPlane(_message.Message):
    __slots__ = ("backend", "agent_name", "metadata")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    backend: str
    agent_name: str
    metadata: bytes
    def __init__(self, backend: _Optional[str] = ..., agent_name: _Optional[str] = ..., metadata: _Optional[bytes] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("protocol_version", "engine_id", "instance_id", "epoch", "rank", "groups", "data_plane", "address", "role")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    engine_id: str
    instance_id: str
    epoch: int
    rank: _common_pb2.Rank
    groups: _containers.RepeatedCompositeFieldContainer[GroupLayout]
    data_plane: DataPlane
    address: str
    role: str
    def __init__(self, protocol_version: _Optional[int] = ..., engine_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., epoch: _Optional[int] = ..., rank: _Optional[_Union[_common_pb2.Rank, _Mapping]] = ..., groups: _Optional[_Iterable[_Union[GroupLayout, _Mapping]]] = ..., data_plane: _Optional[_Union[DataPlane, _Mapping]] = ..., address: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: PeerInfo
    def __init__(self, info: _Optional[_Union[PeerInfo, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: PeerInfo
    def __init__(self, info: _Optional[_Union[PeerInfo, _Mapping]] = ...) -> None: ...

class GetPublishedRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "instance_id", "rank")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    instance_id: str
    rank: _common_pb2.Rank
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., rank: _Optional[_Union[_common_pb2.Rank, _Mapping]] = ...) -> None: ...

class PublishedGroup(_message.Message):
    __slots__ = ("name", "block_ids", "regions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    regions: _containers.RepeatedCompositeFieldContainer[_common_pb2.Region]
    def __init__(self, name: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., regions: _Optional[_Iterable[_Union[_common_pb2.Region, _Mapping]]] = ...) -> None: ...

class GetPublishedResponse(_message.Message):
    __slots__ = ("request_id", "instance_id", "epoch", "groups", "expires_unix_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instance_id: str
    epoch: int
    groups: _containers.RepeatedCompositeFieldContainer[PublishedGroup]
    expires_unix_ms: int
    def __init__(self, request_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., epoch: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[PublishedGroup, _Mapping]]] = ..., expires_unix_ms: _Optional[int] = ...) -> None: ...

class NotifyRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "instance_id", "rank", "outcome", "message", "bytes")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[NotifyRequest.Outcome]
        DONE: _ClassVar[NotifyRequest.Outcome]
        FAILED: _ClassVar[NotifyRequest.Outcome]
    OUTCOME_UNSPECIFIED: NotifyRequest.Outcome
    DONE: NotifyRequest.Outcome
    FAILED: NotifyRequest.Outcome
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    instance_id: str
    rank: _common_pb2.Rank
    outcome: NotifyRequest.Outcome
    message: str
    bytes: int
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., rank: _Optional[_Union[_common_pb2.Rank, _Mapping]] = ..., outcome: _Optional[_Union[NotifyRequest.Outcome, str]] = ..., message: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class NotifyResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PeerAbortRequest(_message.Message):
    __slots__ = ("request_id", "engine_id", "instance_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    instance_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class PeerAbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
