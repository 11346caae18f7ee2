import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.rpc import status_pb2 as _status_pb2
from weightsync._proto import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ("session", "role", "incarnation", "trainer_ranks", "min_rollouts", "weight_sync_mode", "next_version", "flip_policy", "prepare_timeout_seconds", "prepared_loss", "rollout_ids", "max_rollouts")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RANKS_FIELD_NUMBER: _ClassVar[int]
    MIN_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_MODE_FIELD_NUMBER: _ClassVar[int]
    NEXT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FLIP_POLICY_FIELD_NUMBER: _ClassVar[int]
    PREPARE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARED_LOSS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    session: str
    role: _types_pb2.Role
    incarnation: str
    trainer_ranks: int
    min_rollouts: int
    weight_sync_mode: str
    next_version: int
    flip_policy: _types_pb2.FlipPolicy
    prepare_timeout_seconds: float
    prepared_loss: _types_pb2.PreparedLoss
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    max_rollouts: int
    def __init__(self, session: _Optional[str] = ..., role: _Optional[_Union[_types_pb2.Role, str]] = ..., incarnation: _Optional[str] = ..., trainer_ranks: _Optional[int] = ..., min_rollouts: _Optional[int] = ..., weight_sync_mode: _Optional[str] = ..., next_version: _Optional[int] = ..., flip_policy: _Optional[_Union[_types_pb2.FlipPolicy, str]] = ..., prepare_timeout_seconds: _Optional[float] = ..., prepared_loss: _Optional[_Union[_types_pb2.PreparedLoss, str]] = ..., rollout_ids: _Optional[_Iterable[str]] = ..., max_rollouts: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session", "generation", "trainer_ranks", "min_rollouts", "created", "latest_version", "weight_sync_mode", "token_key", "lease_ttl_seconds", "flip_policy", "prepare_timeout_seconds", "prepared_loss", "rollout_ids", "max_rollouts")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RANKS_FIELD_NUMBER: _ClassVar[int]
    MIN_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_MODE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FLIP_POLICY_FIELD_NUMBER: _ClassVar[int]
    PREPARE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARED_LOSS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    session: str
    generation: int
    trainer_ranks: int
    min_rollouts: int
    created: bool
    latest_version: int
    weight_sync_mode: str
    token_key: str
    lease_ttl_seconds: float
    flip_policy: _types_pb2.FlipPolicy
    prepare_timeout_seconds: float
    prepared_loss: _types_pb2.PreparedLoss
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    max_rollouts: int
    def __init__(self, session: _Optional[str] = ..., generation: _Optional[int] = ..., trainer_ranks: _Optional[int] = ..., min_rollouts: _Optional[int] = ..., created: _Optional[bool] = ..., latest_version: _Optional[int] = ..., weight_sync_mode: _Optional[str] = ..., token_key: _Optional[str] = ..., lease_ttl_seconds: _Optional[float] = ..., flip_policy: _Optional[_Union[_types_pb2.FlipPolicy, str]] = ..., prepare_timeout_seconds: _Optional[float] = ..., prepared_loss: _Optional[_Union[_types_pb2.PreparedLoss, str]] = ..., rollout_ids: _Optional[_Iterable[str]] = ..., max_rollouts: _Optional[int] = ...) -> None: ...

class RegisterAgentRequest(_message.Message):
    __slots__ = ("session", "agent_id", "role", "endpoint", "rank", "generation", "instance", "agent_key")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    AGENT_KEY_FIELD_NUMBER: _ClassVar[int]
    session: str
    agent_id: str
    role: _types_pb2.Role
    endpoint: _types_pb2.Endpoint
    rank: int
    generation: int
    instance: str
    agent_key: str
    def __init__(self, session: _Optional[str] = ..., agent_id: _Optional[str] = ..., role: _Optional[_Union[_types_pb2.Role, str]] = ..., endpoint: _Optional[_Union[_types_pb2.Endpoint, _Mapping]] = ..., rank: _Optional[int] = ..., generation: _Optional[int] = ..., instance: _Optional[str] = ..., agent_key: _Optional[str] = ...) -> None: ...

class RegisterAgentResponse(_message.Message):
    __slots__ = ("generation", "lease_ttl_seconds", "session_uid", "agent_key")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_UID_FIELD_NUMBER: _ClassVar[int]
    AGENT_KEY_FIELD_NUMBER: _ClassVar[int]
    generation: int
    lease_ttl_seconds: float
    session_uid: str
    agent_key: str
    def __init__(self, generation: _Optional[int] = ..., lease_ttl_seconds: _Optional[float] = ..., session_uid: _Optional[str] = ..., agent_key: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session", "agent_id", "current_version", "call_id", "get_manifest", "report_applied", "agent_key", "audit")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    GET_MANIFEST_FIELD_NUMBER: _ClassVar[int]
    REPORT_APPLIED_FIELD_NUMBER: _ClassVar[int]
    AGENT_KEY_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    session: str
    agent_id: str
    current_version: int
    call_id: int
    get_manifest: GetManifestRequest
    report_applied: ReportAppliedRequest
    agent_key: str
    audit: _types_pb2.AuditResult
    def __init__(self, session: _Optional[str] = ..., agent_id: _Optional[str] = ..., current_version: _Optional[int] = ..., call_id: _Optional[int] = ..., get_manifest: _Optional[_Union[GetManifestRequest, _Mapping]] = ..., report_applied: _Optional[_Union[ReportAppliedRequest, _Mapping]] = ..., agent_key: _Optional[str] = ..., audit: _Optional[_Union[_types_pb2.AuditResult, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("generation", "lease_ttl_seconds", "carries_calls", "call_id", "last", "manifest_piece", "report_applied", "error", "audit_request")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CARRIES_CALLS_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_PIECE_FIELD_NUMBER: _ClassVar[int]
    REPORT_APPLIED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    AUDIT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    generation: int
    lease_ttl_seconds: float
    carries_calls: bool
    call_id: int
    last: bool
    manifest_piece: ManifestPiece
    report_applied: ReportAppliedResponse
    error: _status_pb2.Status
    audit_request: int
    def __init__(self, generation: _Optional[int] = ..., lease_ttl_seconds: _Optional[float] = ..., carries_calls: _Optional[bool] = ..., call_id: _Optional[int] = ..., last: _Optional[bool] = ..., manifest_piece: _Optional[_Union[ManifestPiece, _Mapping]] = ..., report_applied: _Optional[_Union[ReportAppliedResponse, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., audit_request: _Optional[int] = ...) -> None: ...

class DeregisterAgentRequest(_message.Message):
    __slots__ = ("session", "agent_id", "agent_key")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_KEY_FIELD_NUMBER: _ClassVar[int]
    session: str
    agent_id: str
    agent_key: str
    def __init__(self, session: _Optional[str] = ..., agent_id: _Optional[str] = ..., agent_key: _Optional[str] = ...) -> None: ...

class DeregisterAgentResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session", "force")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    session: str
    force: bool
    def __init__(self, session: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ("versions", "agents")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    versions: int
    agents: int
    def __init__(self, versions: _Optional[int] = ..., agents: _Optional[int] = ...) -> None: ...

class PublishHeader(_message.Message):
    __slots__ = ("session", "generation", "version", "rank", "idempotency_key", "total_bytes", "chunk_bytes", "tensor_count", "shard_count", "chunk_count", "endpoint", "stage_seconds", "delta")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    session: str
    generation: int
    version: int
    rank: int
    idempotency_key: str
    total_bytes: int
    chunk_bytes: int
    tensor_count: int
    shard_count: int
    chunk_count: int
    endpoint: _types_pb2.Endpoint
    stage_seconds: float
    delta: _types_pb2.PartDelta
    def __init__(self, session: _Optional[str] = ..., generation: _Optional[int] = ..., version: _Optional[int] = ..., rank: _Optional[int] = ..., idempotency_key: _Optional[str] = ..., total_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., tensor_count: _Optional[int] = ..., shard_count: _Optional[int] = ..., chunk_count: _Optional[int] = ..., endpoint: _Optional[_Union[_types_pb2.Endpoint, _Mapping]] = ..., stage_seconds: _Optional[float] = ..., delta: _Optional[_Union[_types_pb2.PartDelta, _Mapping]] = ...) -> None: ...

class PublishSeal(_message.Message):
    __slots__ = ("part_digest",)
    PART_DIGEST_FIELD_NUMBER: _ClassVar[int]
    part_digest: str
    def __init__(self, part_digest: _Optional[str] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("header", "batch", "seal")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    header: PublishHeader
    batch: _types_pb2.DescriptorBatch
    seal: PublishSeal
    def __init__(self, header: _Optional[_Union[PublishHeader, _Mapping]] = ..., batch: _Optional[_Union[_types_pb2.DescriptorBatch, _Mapping]] = ..., seal: _Optional[_Union[PublishSeal, _Mapping]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("version", "duplicate")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    version: _types_pb2.VersionInfo
    duplicate: bool
    def __init__(self, version: _Optional[_Union[_types_pb2.VersionInfo, _Mapping]] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("session", "version", "agent_id", "agent_key")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_KEY_FIELD_NUMBER: _ClassVar[int]
    session: str
    version: int
    agent_id: str
    agent_key: str
    def __init__(self, session: _Optional[str] = ..., version: _Optional[int] = ..., agent_id: _Optional[str] = ..., agent_key: _Optional[str] = ...) -> None: ...

class ManifestHeader(_message.Message):
    __slots__ = ("version", "chunk_bytes", "digest_algorithm", "parts", "aggregates", "weight_sync_mode", "access_token", "relay_chain", "ready_age_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_MODE_FIELD_NUMBER: _ClassVar[int]
    ACCESS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RELAY_CHAIN_FIELD_NUMBER: _ClassVar[int]
    READY_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: _types_pb2.VersionInfo
    chunk_bytes: int
    digest_algorithm: str
    parts: _containers.RepeatedCompositeFieldContainer[_types_pb2.RankPart]
    aggregates: _types_pb2.Aggregates
    weight_sync_mode: str
    access_token: str
    relay_chain: _containers.RepeatedCompositeFieldContainer[RelayPeer]
    ready_age_seconds: float
    def __init__(self, version: _Optional[_Union[_types_pb2.VersionInfo, _Mapping]] = ..., chunk_bytes: _Optional[int] = ..., digest_algorithm: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[_types_pb2.RankPart, _Mapping]]] = ..., aggregates: _Optional[_Union[_types_pb2.Aggregates, _Mapping]] = ..., weight_sync_mode: _Optional[str] = ..., access_token: _Optional[str] = ..., relay_chain: _Optional[_Iterable[_Union[RelayPeer, _Mapping]]] = ..., ready_age_seconds: _Optional[float] = ...) -> None: ...

class RelayPeer(_message.Message):
    __slots__ = ("agent_id", "endpoint")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    endpoint: _types_pb2.Endpoint
    def __init__(self, agent_id: _Optional[str] = ..., endpoint: _Optional[_Union[_types_pb2.Endpoint, _Mapping]] = ...) -> None: ...

class ManifestPiece(_message.Message):
    __slots__ = ("header", "batch")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    header: ManifestHeader
    batch: _types_pb2.DescriptorBatch
    def __init__(self, header: _Optional[_Union[ManifestHeader, _Mapping]] = ..., batch: _Optional[_Union[_types_pb2.DescriptorBatch, _Mapping]] = ...) -> None: ...

class WatchVersionsRequest(_message.Message):
    __slots__ = ("session", "since_seq")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    session: str
    since_seq: int
    def __init__(self, session: _Optional[str] = ..., since_seq: _Optional[int] = ...) -> None: ...

class VersionEvent(_message.Message):
    __slots__ = ("seq", "version")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    seq: int
    version: _types_pb2.VersionInfo
    def __init__(self, seq: _Optional[int] = ..., version: _Optional[_Union[_types_pb2.VersionInfo, _Mapping]] = ...) -> None: ...

class TensorDigest(_message.Message):
    __slots__ = ("name", "xxh3", "sum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    xxh3: int
    sum: float
    def __init__(self, name: _Optional[str] = ..., xxh3: _Optional[int] = ..., sum: _Optional[float] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("pull_seconds", "verify_seconds", "apply_seconds", "total_seconds", "pause_seconds", "ready_to_serving_seconds")
    PULL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READY_TO_SERVING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pull_seconds: float
    verify_seconds: float
    apply_seconds: float
    total_seconds: float
    pause_seconds: float
    ready_to_serving_seconds: float
    def __init__(self, pull_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., apply_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., pause_seconds: _Optional[float] = ..., ready_to_serving_seconds: _Optional[float] = ...) -> None: ...

class ReportAppliedRequest(_message.Message):
    __slots__ = ("session", "version", "agent_id", "manifest_digest", "tensors", "aggregates", "consumed_names", "timings", "bytes_pulled", "local_error", "agent_key", "prepared", "flipped_at")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATES_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_NAMES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ERROR_FIELD_NUMBER: _ClassVar[int]
    AGENT_KEY_FIELD_NUMBER: _ClassVar[int]
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    FLIPPED_AT_FIELD_NUMBER: _ClassVar[int]
    session: str
    version: int
    agent_id: str
    manifest_digest: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorDigest]
    aggregates: _types_pb2.Aggregates
    consumed_names: _containers.RepeatedScalarFieldContainer[str]
    timings: Timings
    bytes_pulled: int
    local_error: str
    agent_key: str
    prepared: bool
    flipped_at: _timestamp_pb2.Timestamp
    def __init__(self, session: _Optional[str] = ..., version: _Optional[int] = ..., agent_id: _Optional[str] = ..., manifest_digest: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorDigest, _Mapping]]] = ..., aggregates: _Optional[_Union[_types_pb2.Aggregates, _Mapping]] = ..., consumed_names: _Optional[_Iterable[str]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., bytes_pulled: _Optional[int] = ..., local_error: _Optional[str] = ..., agent_key: _Optional[str] = ..., prepared: _Optional[bool] = ..., flipped_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReportAppliedResponse(_message.Message):
    __slots__ = ("ok", "version", "mismatch")
    OK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    version: _types_pb2.VersionInfo
    mismatch: str
    def __init__(self, ok: _Optional[bool] = ..., version: _Optional[_Union[_types_pb2.VersionInfo, _Mapping]] = ..., mismatch: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("session", "version_limit")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_LIMIT_FIELD_NUMBER: _ClassVar[int]
    session: str
    version_limit: int
    def __init__(self, session: _Optional[str] = ..., version_limit: _Optional[int] = ...) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("agent_id", "role", "endpoint", "rank", "alive", "current_version", "generation", "lease_expires_at")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    role: _types_pb2.Role
    endpoint: _types_pb2.Endpoint
    rank: int
    alive: bool
    current_version: int
    generation: int
    lease_expires_at: _timestamp_pb2.Timestamp
    def __init__(self, agent_id: _Optional[str] = ..., role: _Optional[_Union[_types_pb2.Role, str]] = ..., endpoint: _Optional[_Union[_types_pb2.Endpoint, _Mapping]] = ..., rank: _Optional[int] = ..., alive: _Optional[bool] = ..., current_version: _Optional[int] = ..., generation: _Optional[int] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class HandshakeInfo(_message.Message):
    __slots__ = ("version", "agent_id", "ok", "mismatch", "timings", "bytes_pulled", "reported_at", "flipped_at")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_FIELD_NUMBER: _ClassVar[int]
    FLIPPED_AT_FIELD_NUMBER: _ClassVar[int]
    version: int
    agent_id: str
    ok: bool
    mismatch: str
    timings: Timings
    bytes_pulled: int
    reported_at: _timestamp_pb2.Timestamp
    flipped_at: _timestamp_pb2.Timestamp
    def __init__(self, version: _Optional[int] = ..., agent_id: _Optional[str] = ..., ok: _Optional[bool] = ..., mismatch: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., bytes_pulled: _Optional[int] = ..., reported_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., flipped_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("session", "generation", "trainer_ranks", "min_rollouts", "versions", "agents", "handshakes", "parts", "event_seq", "flip_policy", "prepare_timeout_seconds", "prepared_loss")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RANKS_FIELD_NUMBER: _ClassVar[int]
    MIN_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKES_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    FLIP_POLICY_FIELD_NUMBER: _ClassVar[int]
    PREPARE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARED_LOSS_FIELD_NUMBER: _ClassVar[int]
    session: str
    generation: int
    trainer_ranks: int
    min_rollouts: int
    versions: _containers.RepeatedCompositeFieldContainer[_types_pb2.VersionInfo]
    agents: _containers.RepeatedCompositeFieldContainer[AgentInfo]
    handshakes: _containers.RepeatedCompositeFieldContainer[HandshakeInfo]
    parts: _containers.RepeatedCompositeFieldContainer[_types_pb2.RankPart]
    event_seq: int
    flip_policy: _types_pb2.FlipPolicy
    prepare_timeout_seconds: float
    prepared_loss: _types_pb2.PreparedLoss
    def __init__(self, session: _Optional[str] = ..., generation: _Optional[int] = ..., trainer_ranks: _Optional[int] = ..., min_rollouts: _Optional[int] = ..., versions: _Optional[_Iterable[_Union[_types_pb2.VersionInfo, _Mapping]]] = ..., agents: _Optional[_Iterable[_Union[AgentInfo, _Mapping]]] = ..., handshakes: _Optional[_Iterable[_Union[HandshakeInfo, _Mapping]]] = ..., parts: _Optional[_Iterable[_Union[_types_pb2.RankPart, _Mapping]]] = ..., event_seq: _Optional[int] = ..., flip_policy: _Optional[_Union[_types_pb2.FlipPolicy, str]] = ..., prepare_timeout_seconds: _Optional[float] = ..., prepared_loss: _Optional[_Union[_types_pb2.PreparedLoss, str]] = ...) -> None: ...

class AbortVersionRequest(_message.Message):
    __slots__ = ("session", "generation", "version", "reason")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session: str
    generation: int
    version: int
    reason: str
    def __init__(self, session: _Optional[str] = ..., generation: _Optional[int] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseVersionRequest(_message.Message):
    __slots__ = ("session", "version", "force", "generation", "unpin")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    UNPIN_FIELD_NUMBER: _ClassVar[int]
    session: str
    version: int
    force: bool
    generation: int
    unpin: bool
    def __init__(self, session: _Optional[str] = ..., version: _Optional[int] = ..., force: _Optional[bool] = ..., generation: _Optional[int] = ..., unpin: _Optional[bool] = ...) -> None: ...

class AuditSessionRequest(_message.Message):
    __slots__ = ("session", "fresh", "wait_seconds")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    FRESH_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session: str
    fresh: bool
    wait_seconds: float
    def __init__(self, session: _Optional[str] = ..., fresh: _Optional[bool] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class RolloutAudit(_message.Message):
    __slots__ = ("agent_id", "current_version", "audit", "answered")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    current_version: int
    audit: _types_pb2.AuditResult
    answered: bool
    def __init__(self, agent_id: _Optional[str] = ..., current_version: _Optional[int] = ..., audit: _Optional[_Union[_types_pb2.AuditResult, _Mapping]] = ..., answered: _Optional[bool] = ...) -> None: ...

class AuditSessionResponse(_message.Message):
    __slots__ = ("session", "committed_version", "rollouts", "request_seq")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SEQ_FIELD_NUMBER: _ClassVar[int]
    session: str
    committed_version: int
    rollouts: _containers.RepeatedCompositeFieldContainer[RolloutAudit]
    request_seq: int
    def __init__(self, session: _Optional[str] = ..., committed_version: _Optional[int] = ..., rollouts: _Optional[_Iterable[_Union[RolloutAudit, _Mapping]]] = ..., request_seq: _Optional[int] = ...) -> None: ...
