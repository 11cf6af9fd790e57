from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Layout(_message.Message):
    __slots__ = ("kind", "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size", "dtype", "order", "cross_layer", "total_kv_heads")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    CROSS_LAYER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    order: str
    cross_layer: bool
    total_kv_heads: int
    def __init__(self, kind: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ..., order: _Optional[str] = ..., cross_layer: _Optional[bool] = ..., total_kv_heads: _Optional[int] = ...) -> None: ...

class Rank(_message.Message):
    __slots__ = ("tp_rank", "tp_size", "pp_rank", "pp_size")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    def __init__(self, tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ...) -> None: ...

class BlockList(_message.Message):
    __slots__ = ("group", "block_ids")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    group: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("base", "size", "device")
    BASE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    base: int
    size: int
    device: int
    def __init__(self, base: _Optional[int] = ..., size: _Optional[int] = ..., device: _Optional[int] = ...) -> None: ...
