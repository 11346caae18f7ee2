from weightsync._proto import coordinator_pb2 as _coordinator_pb2
from weightsync._proto import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SyncRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class SyncResponse(_message.Message):
    __slots__ = ("version", "ok", "mismatch", "bytes_pulled", "timings", "chunk_retries")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_RETRIES_FIELD_NUMBER: _ClassVar[int]
    version: int
    ok: bool
    mismatch: str
    bytes_pulled: int
    timings: _coordinator_pb2.Timings
    chunk_retries: int
    def __init__(self, version: _Optional[int] = ..., ok: _Optional[bool] = ..., mismatch: _Optional[str] = ..., bytes_pulled: _Optional[int] = ..., timings: _Optional[_Union[_coordinator_pb2.Timings, _Mapping]] = ..., chunk_retries: _Optional[int] = ...) -> None: ...

class RolloutStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("session", "agent_id", "current_version", "syncs_ok", "syncs_failed", "chunk_retries", "last_error", "completion", "recent_completions", "host_memory", "audit", "unserved_version", "ready", "committed_version")
    class RecentCompletionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNCS_OK_FIELD_NUMBER: _ClassVar[int]
    SYNCS_FAILED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_RETRIES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    RECENT_COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    UNSERVED_VERSION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    agent_id: str
    current_version: int
    syncs_ok: int
    syncs_failed: int
    chunk_retries: int
    last_error: str
    completion: str
    recent_completions: _containers.ScalarMap[int, str]
    host_memory: HostMemory
    audit: _types_pb2.AuditResult
    unserved_version: int
    ready: bool
    committed_version: int
    def __init__(self, session: _Optional[str] = ..., agent_id: _Optional[str] = ..., current_version: _Optional[int] = ..., syncs_ok: _Optional[int] = ..., syncs_failed: _Optional[int] = ..., chunk_retries: _Optional[int] = ..., last_error: _Optional[str] = ..., completion: _Optional[str] = ..., recent_completions: _Optional[_Mapping[int, str]] = ..., host_memory: _Optional[_Union[HostMemory, _Mapping]] = ..., audit: _Optional[_Union[_types_pb2.AuditResult, _Mapping]] = ..., unserved_version: _Optional[int] = ..., ready: _Optional[bool] = ..., committed_version: _Optional[int] = ...) -> None: ...

class HostMemory(_message.Message):
    __slots__ = ("rss", "anon", "file", "shmem", "peak", "limit", "receive_bytes")
    RSS_FIELD_NUMBER: _ClassVar[int]
    ANON_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    SHMEM_FIELD_NUMBER: _ClassVar[int]
    PEAK_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    rss: int
    anon: int
    file: int
    shmem: int
    peak: int
    limit: int
    receive_bytes: int
    def __init__(self, rss: _Optional[int] = ..., anon: _Optional[int] = ..., file: _Optional[int] = ..., shmem: _Optional[int] = ..., peak: _Optional[int] = ..., limit: _Optional[int] = ..., receive_bytes: _Optional[int] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "n", "max_tokens", "seed")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    max_tokens: int
    seed: int
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SampledCompletion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "version", "manifest_digest", "spans", "fingerprint")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    version: int
    manifest_digest: str
    spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    fingerprint: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., version: _Optional[int] = ..., manifest_digest: _Optional[str] = ..., spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("version", "manifest_digest", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest_digest: str
    start: int
    end: int
    def __init__(self, version: _Optional[int] = ..., manifest_digest: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[SampledCompletion]
    def __init__(self, completions: _Optional[_Iterable[_Union[SampledCompletion, _Mapping]]] = ...) -> None: ...
