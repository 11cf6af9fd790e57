from kvxfer._proto.kvxfer.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SharedMemory(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[ShmRegion]
    def __init__(self, regions: _Optional[_Iterable[_Union[ShmRegion, _Mapping]]] = ...) -> None: ...

class ShmRegion(_message.Message):
    __slots__ = ("name", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class CudaIpc(_message.Message):
    __slots__ = ("handles", "offsets", "device")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[bytes]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    device: int
    def __init__(self, handles: _Optional[_Iterable[bytes]] = ..., offsets: _Optional[_Iterable[int]] = ..., device: _Optional[int] = ...) -> None: ...

class LibraryMemory(_message.Message):
    __slots__ = ("addresses", "device", "memory_type", "pid")
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[int]
    device: int
    memory_type: str
    pid: int
    def __init__(self, addresses: _Optional[_Iterable[int]] = ..., device: _Optional[int] = ..., memory_type: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class Memory(_message.Message):
    __slots__ = ("shm", "cuda_ipc", "library")
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    LIBRARY_FIELD_NUMBER: _ClassVar[int]
    shm: SharedMemory
    cuda_ipc: CudaIpc
    library: LibraryMemory
    def __init__(self, shm: _Optional[_Union[SharedMemory, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpc, _Mapping]] = ..., library: _Optional[_Union[LibraryMemory, _Mapping]] = ...) -> None: ...

class CacheGroup(_message.Message):
    __slots__ = ("name", "layout", "memory")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    name: str
    layout: _common_pb2.Layout
    memory: Memory
    def __init__(self, name: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ..., memory: _Optional[_Union[Memory, _Mapping]] = ...) -> None: ...

class RegisterCachesRequest(_message.Message):
    __slots__ = ("worker_id", "rank", "groups")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    rank: _common_pb2.Rank
    groups: _containers.RepeatedCompositeFieldContainer[CacheGroup]
    def __init__(self, worker_id: _Optional[str] = ..., rank: _Optional[_Union[_common_pb2.Rank, _Mapping]] = ..., groups: _Optional[_Iterable[_Union[CacheGroup, _Mapping]]] = ...) -> None: ...

class RegisterCachesResponse(_message.Message):
    __slots__ = ("engine_id", "instance_id", "epoch", "registered_bytes", "backend", "peer_address")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    instance_id: str
    epoch: int
    registered_bytes: int
    backend: str
    peer_address: str
    def __init__(self, engine_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., epoch: _Optional[int] = ..., registered_bytes: _Optional[int] = ..., backend: _Optional[str] = ..., peer_address: _Optional[str] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("request_id", "blocks", "lease_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockList]
    lease_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[_common_pb2.BlockList, _Mapping]]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("request_id", "expires_unix_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    expires_unix_ms: int
    def __init__(self, request_id: _Optional[str] = ..., expires_unix_ms: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("request_id", "remote_engine_id", "remote_addresses", "remote_blocks", "local_blocks", "wait", "timeout_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    remote_engine_id: str
    remote_addresses: _containers.RepeatedScalarFieldContainer[str]
    remote_blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockList]
    local_blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockList]
    wait: bool
    timeout_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., remote_engine_id: _Optional[str] = ..., remote_addresses: _Optional[_Iterable[str]] = ..., remote_blocks: _Optional[_Iterable[_Union[_common_pb2.BlockList, _Mapping]]] = ..., local_blocks: _Optional[_Iterable[_Union[_common_pb2.BlockList, _Mapping]]] = ..., wait: _Optional[bool] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("bytes", "descriptors", "duration_seconds", "data_seconds", "remote_ranks", "warnings")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DATA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_RANKS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    descriptors: int
    duration_seconds: float
    data_seconds: float
    remote_ranks: _containers.RepeatedScalarFieldContainer[int]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, bytes: _Optional[int] = ..., descriptors: _Optional[int] = ..., duration_seconds: _Optional[float] = ..., data_seconds: _Optional[float] = ..., remote_ranks: _Optional[_Iterable[int]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("transfer_id", "request_id", "done", "stats")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    done: bool
    stats: TransferStats
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., done: _Optional[bool] = ..., stats: _Optional[_Union[TransferStats, _Mapping]] = ...) -> None: ...

class WatchCompletionsRequest(_message.Message):
    __slots__ = ("replay", "after_sequence")
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    replay: bool
    after_sequence: int
    def __init__(self, replay: _Optional[bool] = ..., after_sequence: _Optional[int] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("sequence", "kind", "request_id", "transfer_id", "code", "message", "peer", "stats", "unix_ms")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Completion.Kind]
        PULLED: _ClassVar[Completion.Kind]
        PULL_FAILED: _ClassVar[Completion.Kind]
        RELEASED: _ClassVar[Completion.Kind]
        EXPIRED: _ClassVar[Completion.Kind]
        ABORTED: _ClassVar[Completion.Kind]
    KIND_UNSPECIFIED: Completion.Kind
    PULLED: Completion.Kind
    PULL_FAILED: Completion.Kind
    RELEASED: Completion.Kind
    EXPIRED: Completion.Kind
    ABORTED: Completion.Kind
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: Completion.Kind
    request_id: str
    transfer_id: str
    code: int
    message: str
    peer: str
    stats: TransferStats
    unix_ms: int
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[Completion.Kind, str]] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., peer: _Optional[str] = ..., stats: _Optional[_Union[TransferStats, _Mapping]] = ..., unix_ms: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_pulls", "aborted_publish")
    ABORTED_PULLS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_PUBLISH_FIELD_NUMBER: _ClassVar[int]
    aborted_pulls: int
    aborted_publish: bool
    def __init__(self, aborted_pulls: _Optional[int] = ..., aborted_publish: _Optional[bool] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_seconds",)
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    def __init__(self, timeout_seconds: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("completed", "abandoned", "released_leases")
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_LEASES_FIELD_NUMBER: _ClassVar[int]
    completed: int
    abandoned: int
    released_leases: int
    def __init__(self, completed: _Optional[int] = ..., abandoned: _Optional[int] = ..., released_leases: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("engine_id", "instance_id", "role", "backend", "registered", "draining", "leases", "transfers_in_flight", "peers", "peer_address", "registered_bytes", "protocol_version")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    instance_id: str
    role: str
    backend: str
    registered: bool
    draining: bool
    leases: int
    transfers_in_flight: int
    peers: int
    peer_address: str
    registered_bytes: int
    protocol_version: int
    def __init__(self, engine_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., role: _Optional[str] = ..., backend: _Optional[str] = ..., registered: _Optional[bool] = ..., draining: _Optional[bool] = ..., leases: _Optional[int] = ..., transfers_in_flight: _Optional[int] = ..., peers: _Optional[int] = ..., peer_address: _Optional[str] = ..., registered_bytes: _Optional[int] = ..., protocol_version: _Optional[int] = ...) -> None: ...
