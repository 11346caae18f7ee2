import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT8: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]

class VersionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERSION_STATE_UNSPECIFIED: _ClassVar[VersionState]
    STAGING: _ClassVar[VersionState]
    READY: _ClassVar[VersionState]
    COMMITTED: _ClassVar[VersionState]
    PARTIAL: _ClassVar[VersionState]
    FAILED: _ClassVar[VersionState]
    RELEASED: _ClassVar[VersionState]

class FlipPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FLIP_POLICY_UNSPECIFIED: _ClassVar[FlipPolicy]
    INDEPENDENT: _ClassVar[FlipPolicy]
    ATOMIC: _ClassVar[FlipPolicy]

class PreparedLoss(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREPARED_LOSS_UNSPECIFIED: _ClassVar[PreparedLoss]
    FLIP_WITHOUT: _ClassVar[PreparedLoss]
    ABORT_FLIP: _ClassVar[PreparedLoss]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    TRAINER: _ClassVar[Role]
    ROLLOUT: _ClassVar[Role]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType
INT8: DType
INT16: DType
INT32: DType
INT64: DType
UINT8: DType
BOOL: DType
VERSION_STATE_UNSPECIFIED: VersionState
STAGING: VersionState
READY: VersionState
COMMITTED: VersionState
PARTIAL: VersionState
FAILED: VersionState
RELEASED: VersionState
FLIP_POLICY_UNSPECIFIED: FlipPolicy
INDEPENDENT: FlipPolicy
ATOMIC: FlipPolicy
PREPARED_LOSS_UNSPECIFIED: PreparedLoss
FLIP_WITHOUT: PreparedLoss
ABORT_FLIP: PreparedLoss
ROLE_UNSPECIFIED: Role
TRAINER: Role
ROLLOUT: Role

class Endpoint(_message.Message):
    __slots__ = ("address", "transports", "host_id", "shm_path", "shm_offset", "fs_uri", "tcp_address")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FS_URI_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    shm_path: str
    shm_offset: int
    fs_uri: str
    tcp_address: str
    def __init__(self, address: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., shm_path: _Optional[str] = ..., shm_offset: _Optional[int] = ..., fs_uri: _Optional[str] = ..., tcp_address: _Optional[str] = ...) -> None: ...

class TensorDescriptor(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardDescriptor(_message.Message):
    __slots__ = ("tensor_name", "start", "stop", "offset", "nbytes", "xxh3", "sum")
    TENSOR_NAME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    tensor_name: str
    start: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    xxh3: int
    sum: float
    def __init__(self, tensor_name: _Optional[str] = ..., start: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., xxh3: _Optional[int] = ..., sum: _Optional[float] = ...) -> None: ...

class ChunkDescriptor(_message.Message):
    __slots__ = ("index", "offset", "length", "xxh3")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    length: int
    xxh3: int
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., xxh3: _Optional[int] = ...) -> None: ...

class DeltaChunkDescriptor(_message.Message):
    __slots__ = ("index", "target", "offset", "length", "xxh3")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    index: int
    target: int
    offset: int
    length: int
    xxh3: int
    def __init__(self, index: _Optional[int] = ..., target: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., xxh3: _Optional[int] = ...) -> None: ...

class PartDelta(_message.Message):
    __slots__ = ("base_version", "base_manifest_digest", "encoding", "total_bytes", "chunk_count", "raw_count")
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    RAW_COUNT_FIELD_NUMBER: _ClassVar[int]
    base_version: int
    base_manifest_digest: str
    encoding: str
    total_bytes: int
    chunk_count: int
    raw_count: int
    def __init__(self, base_version: _Optional[int] = ..., base_manifest_digest: _Optional[str] = ..., encoding: _Optional[str] = ..., total_bytes: _Optional[int] = ..., chunk_count: _Optional[int] = ..., raw_count: _Optional[int] = ...) -> None: ...

class DescriptorBatch(_message.Message):
    __slots__ = ("rank", "tensors", "shards", "chunks", "delta_chunks", "raw_chunks")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DELTA_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    RAW_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorDescriptor]
    shards: _containers.RepeatedCompositeFieldContainer[ShardDescriptor]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkDescriptor]
    delta_chunks: _containers.RepeatedCompositeFieldContainer[DeltaChunkDescriptor]
    raw_chunks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorDescriptor, _Mapping]]] = ..., shards: _Optional[_Iterable[_Union[ShardDescriptor, _Mapping]]] = ..., chunks: _Optional[_Iterable[_Union[ChunkDescriptor, _Mapping]]] = ..., delta_chunks: _Optional[_Iterable[_Union[DeltaChunkDescriptor, _Mapping]]] = ..., raw_chunks: _Optional[_Iterable[int]] = ...) -> None: ...

class Aggregates(_message.Message):
    __slots__ = ("grand_total", "tensor_count", "element_count")
    GRAND_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    grand_total: float
    tensor_count: int
    element_count: int
    def __init__(self, grand_total: _Optional[float] = ..., tensor_count: _Optional[int] = ..., element_count: _Optional[int] = ...) -> None: ...

class RankPart(_message.Message):
    __slots__ = ("rank", "total_bytes", "chunk_count", "endpoint", "stage_seconds", "delta")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    rank: int
    total_bytes: int
    chunk_count: int
    endpoint: Endpoint
    stage_seconds: float
    delta: PartDelta
    def __init__(self, rank: _Optional[int] = ..., total_bytes: _Optional[int] = ..., chunk_count: _Optional[int] = ..., endpoint: _Optional[_Union[Endpoint, _Mapping]] = ..., stage_seconds: _Optional[float] = ..., delta: _Optional[_Union[PartDelta, _Mapping]] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("session", "version", "state", "generation", "manifest_digest", "total_bytes", "sealed_ranks", "trainer_ranks", "reason", "leases", "stage_seconds", "created_at", "ready_at", "committed_at", "flip_policy", "flip_decided_at", "prepared", "flip_skew_seconds")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEALED_RANKS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RANKS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    READY_AT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    FLIP_POLICY_FIELD_NUMBER: _ClassVar[int]
    FLIP_DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    FLIP_SKEW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session: str
    version: int
    state: VersionState
    generation: int
    manifest_digest: str
    total_bytes: int
    sealed_ranks: int
    trainer_ranks: int
    reason: str
    leases: int
    stage_seconds: float
    created_at: _timestamp_pb2.Timestamp
    ready_at: _timestamp_pb2.Timestamp
    committed_at: _timestamp_pb2.Timestamp
    flip_policy: FlipPolicy
    flip_decided_at: _timestamp_pb2.Timestamp
    prepared: int
    flip_skew_seconds: float
    def __init__(self, session: _Optional[str] = ..., version: _Optional[int] = ..., state: _Optional[_Union[VersionState, str]] = ..., generation: _Optional[int] = ..., manifest_digest: _Optional[str] = ..., total_bytes: _Optional[int] = ..., sealed_ranks: _Optional[int] = ..., trainer_ranks: _Optional[int] = ..., reason: _Optional[str] = ..., leases: _Optional[int] = ..., stage_seconds: _Optional[float] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ready_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., committed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., flip_policy: _Optional[_Union[FlipPolicy, str]] = ..., flip_decided_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., prepared: _Optional[int] = ..., flip_skew_seconds: _Optional[float] = ...) -> None: ...

class AuditMismatch(_message.Message):
    __slots__ = ("tensor", "detail")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    detail: str
    def __init__(self, tensor: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class AuditResult(_message.Message):
    __slots__ = ("version", "exact", "tensors", "mismatch_count", "mismatches", "unaudited", "seconds", "age_seconds", "request_seq", "method", "heals", "unserved_version", "audits")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_COUNT_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    UNAUDITED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SEQ_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    HEALS_FIELD_NUMBER: _ClassVar[int]
    UNSERVED_VERSION_FIELD_NUMBER: _ClassVar[int]
    AUDITS_FIELD_NUMBER: _ClassVar[int]
    version: int
    exact: bool
    tensors: int
    mismatch_count: int
    mismatches: _containers.RepeatedCompositeFieldContainer[AuditMismatch]
    unaudited: int
    seconds: float
    age_seconds: float
    request_seq: int
    method: str
    heals: int
    unserved_version: int
    audits: int
    def __init__(self, version: _Optional[int] = ..., exact: _Optional[bool] = ..., tensors: _Optional[int] = ..., mismatch_count: _Optional[int] = ..., mismatches: _Optional[_Iterable[_Union[AuditMismatch, _Mapping]]] = ..., unaudited: _Optional[int] = ..., seconds: _Optional[float] = ..., age_seconds: _Optional[float] = ..., request_seq: _Optional[int] = ..., method: _Optional[str] = ..., heals: _Optional[int] = ..., unserved_version: _Optional[int] = ..., audits: _Optional[int] = ...) -> None: ...
