from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SpeculationOverride(_message.Message):
    __slots__ = ("off", "k")
    OFF_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    off: bool
    k: int
    def __init__(self, off: _Optional[bool] = ..., k: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "chat", "prompt_utf8", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "speculation", "category")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_UTF8_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    chat: ChatMessages
    prompt_utf8: bytes
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculation: SpeculationOverride
    category: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_utf8: _Optional[bytes] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Union[SpeculationOverride, _Mapping]] = ..., category: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_seconds", "time_to_first_token_seconds", "total_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    time_to_first_token_seconds: float
    total_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., time_to_first_token_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class AcceptanceStats(_message.Message):
    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos", "num_draft_tokens_per_pos", "acceptance_rate", "mean_acceptance_length", "acceptance_per_position", "fallback_events", "num_emitted_tokens", "num_target_steps")
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_EVENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TARGET_STEPS_FIELD_NUMBER: _ClassVar[int]
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    acceptance_rate: float
    mean_acceptance_length: float
    acceptance_per_position: _containers.RepeatedScalarFieldContainer[float]
    fallback_events: int
    num_emitted_tokens: int
    num_target_steps: int
    def __init__(self, num_drafts: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., num_draft_tokens_per_pos: _Optional[_Iterable[int]] = ..., acceptance_rate: _Optional[float] = ..., mean_acceptance_length: _Optional[float] = ..., acceptance_per_position: _Optional[_Iterable[float]] = ..., fallback_events: _Optional[int] = ..., num_emitted_tokens: _Optional[int] = ..., num_target_steps: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "timings", "stats")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    stats: AcceptanceStats
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., stats: _Optional[_Union[AcceptanceStats, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelIdentity(_message.Message):
    __slots__ = ("kind", "source", "revision", "path", "parameters", "dtype", "device")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    source: str
    revision: str
    path: str
    parameters: int
    dtype: str
    device: str
    def __init__(self, kind: _Optional[str] = ..., source: _Optional[str] = ..., revision: _Optional[str] = ..., path: _Optional[str] = ..., parameters: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class TokenizerInfo(_message.Message):
    __slots__ = ("target_fingerprint", "draft_fingerprint", "compatible", "differences", "notes")
    TARGET_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    COMPATIBLE_FIELD_NUMBER: _ClassVar[int]
    DIFFERENCES_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    target_fingerprint: str
    draft_fingerprint: str
    compatible: bool
    differences: _containers.RepeatedScalarFieldContainer[str]
    notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, target_fingerprint: _Optional[str] = ..., draft_fingerprint: _Optional[str] = ..., compatible: _Optional[bool] = ..., differences: _Optional[_Iterable[str]] = ..., notes: _Optional[_Iterable[str]] = ...) -> None: ...

class SpeculationSettings(_message.Message):
    __slots__ = ("enabled", "k", "dynamic_k", "k_min", "k_max", "k_override", "fallback_threshold", "fallback_window", "batch_size_threshold", "max_batch_size")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_K_FIELD_NUMBER: _ClassVar[int]
    K_MIN_FIELD_NUMBER: _ClassVar[int]
    K_MAX_FIELD_NUMBER: _ClassVar[int]
    K_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_WINDOW_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    k: int
    dynamic_k: bool
    k_min: int
    k_max: int
    k_override: int
    fallback_threshold: float
    fallback_window: int
    batch_size_threshold: int
    max_batch_size: int
    def __init__(self, enabled: _Optional[bool] = ..., k: _Optional[int] = ..., dynamic_k: _Optional[bool] = ..., k_min: _Optional[int] = ..., k_max: _Optional[int] = ..., k_override: _Optional[int] = ..., fallback_threshold: _Optional[float] = ..., fallback_window: _Optional[int] = ..., batch_size_threshold: _Optional[int] = ..., max_batch_size: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("pair", "version", "target", "draft", "tokenizer", "speculation", "context_length", "max_new_tokens_limit", "max_queue", "engine_version", "warnings", "content_hash", "draft_version", "draft_content_hash")
    PAIR_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    pair: str
    version: str
    target: ModelIdentity
    draft: ModelIdentity
    tokenizer: TokenizerInfo
    speculation: SpeculationSettings
    context_length: int
    max_new_tokens_limit: int
    max_queue: int
    engine_version: str
    warnings: _containers.RepeatedScalarFieldContainer[str]
    content_hash: str
    draft_version: str
    draft_content_hash: str
    def __init__(self, pair: _Optional[str] = ..., version: _Optional[str] = ..., target: _Optional[_Union[ModelIdentity, _Mapping]] = ..., draft: _Optional[_Union[ModelIdentity, _Mapping]] = ..., tokenizer: _Optional[_Union[TokenizerInfo, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationSettings, _Mapping]] = ..., context_length: _Optional[int] = ..., max_new_tokens_limit: _Optional[int] = ..., max_queue: _Optional[int] = ..., engine_version: _Optional[str] = ..., warnings: _Optional[_Iterable[str]] = ..., content_hash: _Optional[str] = ..., draft_version: _Optional[str] = ..., draft_content_hash: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CategoryStats(_message.Message):
    __slots__ = ("window_acceptance_rate", "window_draft_tokens", "cumulative", "requests", "finished", "serving")
    WINDOW_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    window_acceptance_rate: float
    window_draft_tokens: int
    cumulative: AcceptanceStats
    requests: int
    finished: FinishedRequestSums
    serving: ServingStats
    def __init__(self, window_acceptance_rate: _Optional[float] = ..., window_draft_tokens: _Optional[int] = ..., cumulative: _Optional[_Union[AcceptanceStats, _Mapping]] = ..., requests: _Optional[int] = ..., finished: _Optional[_Union[FinishedRequestSums, _Mapping]] = ..., serving: _Optional[_Union[ServingStats, _Mapping]] = ...) -> None: ...

class ServingStats(_message.Message):
    __slots__ = ("time_to_first_token", "time_per_output_token", "requests")
    class RequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIME_PER_OUTPUT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    time_to_first_token: Histogram
    time_per_output_token: Histogram
    requests: _containers.ScalarMap[str, int]
    def __init__(self, time_to_first_token: _Optional[_Union[Histogram, _Mapping]] = ..., time_per_output_token: _Optional[_Union[Histogram, _Mapping]] = ..., requests: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Histogram(_message.Message):
    __slots__ = ("upper_bounds", "counts", "count", "sum")
    UPPER_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    upper_bounds: _containers.RepeatedScalarFieldContainer[float]
    counts: _containers.RepeatedScalarFieldContainer[int]
    count: int
    sum: float
    def __init__(self, upper_bounds: _Optional[_Iterable[float]] = ..., counts: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., sum: _Optional[float] = ...) -> None: ...

class FinishedRequestSums(_message.Message):
    __slots__ = ("requests", "draft_tokens", "accepted_tokens", "draft_tokens_sq", "accepted_tokens_sq", "draft_accepted_tokens")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_SQ_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_SQ_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    draft_tokens: int
    accepted_tokens: int
    draft_tokens_sq: float
    accepted_tokens_sq: float
    draft_accepted_tokens: float
    def __init__(self, requests: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., draft_tokens_sq: _Optional[float] = ..., accepted_tokens_sq: _Optional[float] = ..., draft_accepted_tokens: _Optional[float] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("pair", "version", "overall", "categories", "speculating", "falling_back", "fallback_events", "current_k", "speculation", "num_requests_running", "num_requests_waiting", "uptime_seconds", "shadow", "captured")
    class CategoriesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: CategoryStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[CategoryStats, _Mapping]] = ...) -> None: ...
    class CapturedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PAIR_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OVERALL_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    SPECULATING_FIELD_NUMBER: _ClassVar[int]
    FALLING_BACK_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_EVENTS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_K_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_FIELD_NUMBER: _ClassVar[int]
    pair: str
    version: str
    overall: CategoryStats
    categories: _containers.MessageMap[str, CategoryStats]
    speculating: bool
    falling_back: bool
    fallback_events: int
    current_k: int
    speculation: SpeculationSettings
    num_requests_running: int
    num_requests_waiting: int
    uptime_seconds: float
    shadow: ShadowStats
    captured: _containers.ScalarMap[str, int]
    def __init__(self, pair: _Optional[str] = ..., version: _Optional[str] = ..., overall: _Optional[_Union[CategoryStats, _Mapping]] = ..., categories: _Optional[_Mapping[str, CategoryStats]] = ..., speculating: _Optional[bool] = ..., falling_back: _Optional[bool] = ..., fallback_events: _Optional[int] = ..., current_k: _Optional[int] = ..., speculation: _Optional[_Union[SpeculationSettings, _Mapping]] = ..., num_requests_running: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., shadow: _Optional[_Union[ShadowStats, _Mapping]] = ..., captured: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ShadowStats(_message.Message):
    __slots__ = ("candidate_version", "candidate_content_hash", "share", "skipped_steps", "categories")
    class CategoriesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ShadowCategoryStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ShadowCategoryStats, _Mapping]] = ...) -> None: ...
    CANDIDATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    candidate_version: str
    candidate_content_hash: str
    share: float
    skipped_steps: int
    categories: _containers.MessageMap[str, ShadowCategoryStats]
    def __init__(self, candidate_version: _Optional[str] = ..., candidate_content_hash: _Optional[str] = ..., share: _Optional[float] = ..., skipped_steps: _Optional[int] = ..., categories: _Optional[_Mapping[str, ShadowCategoryStats]] = ...) -> None: ...

class ShadowCategoryStats(_message.Message):
    __slots__ = ("requests", "candidate_alpha", "champion_alpha", "candidate_chain", "champion_chain", "draft_seconds", "committed_tokens", "alpha_paired", "chain_paired")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_ALPHA_FIELD_NUMBER: _ClassVar[int]
    CHAMPION_ALPHA_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_CHAIN_FIELD_NUMBER: _ClassVar[int]
    CHAMPION_CHAIN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALPHA_PAIRED_FIELD_NUMBER: _ClassVar[int]
    CHAIN_PAIRED_FIELD_NUMBER: _ClassVar[int]
    requests: int
    candidate_alpha: AlphaSums
    champion_alpha: AlphaSums
    candidate_chain: FinishedRequestSums
    champion_chain: FinishedRequestSums
    draft_seconds: float
    committed_tokens: int
    alpha_paired: PairedSums
    chain_paired: PairedSums
    def __init__(self, requests: _Optional[int] = ..., candidate_alpha: _Optional[_Union[AlphaSums, _Mapping]] = ..., champion_alpha: _Optional[_Union[AlphaSums, _Mapping]] = ..., candidate_chain: _Optional[_Union[FinishedRequestSums, _Mapping]] = ..., champion_chain: _Optional[_Union[FinishedRequestSums, _Mapping]] = ..., draft_seconds: _Optional[float] = ..., committed_tokens: _Optional[int] = ..., alpha_paired: _Optional[_Union[PairedSums, _Mapping]] = ..., chain_paired: _Optional[_Union[PairedSums, _Mapping]] = ...) -> None: ...

class PairedSums(_message.Message):
    __slots__ = ("requests", "accepted_both", "accepted_drafted", "drafted_accepted", "drafted_both")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BOTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_BOTH_FIELD_NUMBER: _ClassVar[int]
    requests: int
    accepted_both: float
    accepted_drafted: float
    drafted_accepted: float
    drafted_both: float
    def __init__(self, requests: _Optional[int] = ..., accepted_both: _Optional[float] = ..., accepted_drafted: _Optional[float] = ..., drafted_accepted: _Optional[float] = ..., drafted_both: _Optional[float] = ...) -> None: ...

class AlphaSums(_message.Message):
    __slots__ = ("requests", "positions", "alpha", "positions_sq", "alpha_sq", "positions_alpha")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_SQ_FIELD_NUMBER: _ClassVar[int]
    ALPHA_SQ_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_ALPHA_FIELD_NUMBER: _ClassVar[int]
    requests: int
    positions: int
    alpha: float
    positions_sq: float
    alpha_sq: float
    positions_alpha: float
    def __init__(self, requests: _Optional[int] = ..., positions: _Optional[int] = ..., alpha: _Optional[float] = ..., positions_sq: _Optional[float] = ..., alpha_sq: _Optional[float] = ..., positions_alpha: _Optional[float] = ...) -> None: ...

class SetSpeculationRequest(_message.Message):
    __slots__ = ("enabled", "k", "reason")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    k: int
    reason: str
    def __init__(self, enabled: _Optional[bool] = ..., k: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SwapDraftRequest(_message.Message):
    __slots__ = ("release_json", "reason")
    RELEASE_JSON_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    release_json: str
    reason: str
    def __init__(self, release_json: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SwapDraftReply(_message.Message):
    __slots__ = ("swapped", "draft_version", "draft_content_hash", "draft", "load_seconds", "install_seconds")
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INSTALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    swapped: bool
    draft_version: str
    draft_content_hash: str
    draft: ModelIdentity
    load_seconds: float
    install_seconds: float
    def __init__(self, swapped: _Optional[bool] = ..., draft_version: _Optional[str] = ..., draft_content_hash: _Optional[str] = ..., draft: _Optional[_Union[ModelIdentity, _Mapping]] = ..., load_seconds: _Optional[float] = ..., install_seconds: _Optional[float] = ...) -> None: ...
