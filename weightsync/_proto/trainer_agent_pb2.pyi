from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReadChunksRequest(_message.Message):
    __slots__ = ("session", "version", "rank", "indices", "access_token")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    ACCESS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session: str
    version: int
    rank: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    access_token: str
    def __init__(self, session: _Optional[str] = ..., version: _Optional[int] = ..., rank: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ..., access_token: _Optional[str] = ...) -> None: ...

class ChunkData(_message.Message):
    __slots__ = ("index", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SlotInfo(_message.Message):
    __slots__ = ("slot", "version", "total_bytes", "chunk_count")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    slot: int
    version: int
    total_bytes: int
    chunk_count: int
    def __init__(self, slot: _Optional[int] = ..., version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., chunk_count: _Optional[int] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("session", "rank", "generation", "arena_bytes", "slots", "bytes_served", "latest_version")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    rank: int
    generation: int
    arena_bytes: int
    slots: _containers.RepeatedCompositeFieldContainer[SlotInfo]
    bytes_served: int
    latest_version: int
    def __init__(self, session: _Optional[str] = ..., rank: _Optional[int] = ..., generation: _Optional[int] = ..., arena_bytes: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[SlotInfo, _Mapping]]] = ..., bytes_served: _Optional[int] = ..., latest_version: _Optional[int] = ...) -> None: ...
