from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReleaseOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_OUTCOME_UNSPECIFIED: _ClassVar[ReleaseOutcome]
    CONSUMED: _ClassVar[ReleaseOutcome]
    RETURNED: _ClassVar[ReleaseOutcome]
    CORRUPT: _ClassVar[ReleaseOutcome]
RELEASE_OUTCOME_UNSPECIFIED: ReleaseOutcome
CONSUMED: ReleaseOutcome
RETURNED: ReleaseOutcome
CORRUPT: ReleaseOutcome

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, datasets: _Optional[_Iterable[str]] = ...) -> None: ...

class GetMetaRequest(_message.Message):
    __slots__ = ("dataset",)
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    def __init__(self, dataset: _Optional[str] = ...) -> None: ...

class GetMetaResponse(_message.Message):
    __slots__ = ("dataset", "meta_json", "training_type", "batch_size", "batches_per_file", "data_root", "mode", "splits", "lease_ttl_ms", "data_root_id")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    META_JSON_FIELD_NUMBER: _ClassVar[int]
    TRAINING_TYPE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_FILE_FIELD_NUMBER: _ClassVar[int]
    DATA_ROOT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_ROOT_ID_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    meta_json: str
    training_type: str
    batch_size: int
    batches_per_file: int
    data_root: str
    mode: str
    splits: _containers.RepeatedScalarFieldContainer[str]
    lease_ttl_ms: int
    data_root_id: str
    def __init__(self, dataset: _Optional[str] = ..., meta_json: _Optional[str] = ..., training_type: _Optional[str] = ..., batch_size: _Optional[int] = ..., batches_per_file: _Optional[int] = ..., data_root: _Optional[str] = ..., mode: _Optional[str] = ..., splits: _Optional[_Iterable[str]] = ..., lease_ttl_ms: _Optional[int] = ..., data_root_id: _Optional[str] = ...) -> None: ...

class GetSchemaRequest(_message.Message):
    __slots__ = ("dataset", "split")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    split: str
    def __init__(self, dataset: _Optional[str] = ..., split: _Optional[str] = ...) -> None: ...

class FieldSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "role", "stored_dtype", "storage")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STORED_DTYPE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    role: str
    stored_dtype: str
    storage: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., role: _Optional[str] = ..., stored_dtype: _Optional[str] = ..., storage: _Optional[str] = ...) -> None: ...

class GetSchemaResponse(_message.Message):
    __slots__ = ("dataset", "split", "batch_size", "fields")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    split: str
    batch_size: int
    fields: _containers.RepeatedCompositeFieldContainer[FieldSpec]
    def __init__(self, dataset: _Optional[str] = ..., split: _Optional[str] = ..., batch_size: _Optional[int] = ..., fields: _Optional[_Iterable[_Union[FieldSpec, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("dataset",)
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    def __init__(self, dataset: _Optional[str] = ...) -> None: ...

class RankStats(_message.Message):
    __slots__ = ("rank", "last_consumed_seq", "files_leased", "lag_files", "ready_files", "duplicate_clients")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAST_CONSUMED_SEQ_FIELD_NUMBER: _ClassVar[int]
    FILES_LEASED_FIELD_NUMBER: _ClassVar[int]
    LAG_FILES_FIELD_NUMBER: _ClassVar[int]
    READY_FILES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    last_consumed_seq: int
    files_leased: int
    lag_files: int
    ready_files: int
    duplicate_clients: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., last_consumed_seq: _Optional[int] = ..., files_leased: _Optional[int] = ..., lag_files: _Optional[int] = ..., ready_files: _Optional[int] = ..., duplicate_clients: _Optional[_Iterable[str]] = ...) -> None: ...

class SplitStats(_message.Message):
    __slots__ = ("split", "produced_files", "consumed_files", "quarantined_files", "ready_files", "leased_files", "leases_expired", "produced_bytes", "worker_restarts", "max_backlog_files", "world_size", "next_seq", "ranks", "reproduced_files", "worker_pids", "disk_errors", "last_disk_error", "seqs_produced", "seqs_consumed", "seqs_quarantined", "seqs_missing", "curriculum", "mixture", "journal_error", "worker_backoff_s", "last_worker_error", "tokens_per_s", "batches_per_s", "rate_window_s", "tokens_served", "tokens_per_file", "epochs", "epoch_eta_s", "worker_rss_bytes", "warnings", "workers")
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    PRODUCED_FILES_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FILES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FILES_FIELD_NUMBER: _ClassVar[int]
    READY_FILES_FIELD_NUMBER: _ClassVar[int]
    LEASED_FILES_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PRODUCED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BACKLOG_FILES_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    REPRODUCED_FILES_FIELD_NUMBER: _ClassVar[int]
    WORKER_PIDS_FIELD_NUMBER: _ClassVar[int]
    DISK_ERRORS_FIELD_NUMBER: _ClassVar[int]
    LAST_DISK_ERROR_FIELD_NUMBER: _ClassVar[int]
    SEQS_PRODUCED_FIELD_NUMBER: _ClassVar[int]
    SEQS_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    SEQS_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    SEQS_MISSING_FIELD_NUMBER: _ClassVar[int]
    CURRICULUM_FIELD_NUMBER: _ClassVar[int]
    MIXTURE_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_BACKOFF_S_FIELD_NUMBER: _ClassVar[int]
    LAST_WORKER_ERROR_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_S_FIELD_NUMBER: _ClassVar[int]
    RATE_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SERVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_FILE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_ETA_S_FIELD_NUMBER: _ClassVar[int]
    WORKER_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    split: str
    produced_files: int
    consumed_files: int
    quarantined_files: int
    ready_files: int
    leased_files: int
    leases_expired: int
    produced_bytes: int
    worker_restarts: int
    max_backlog_files: int
    world_size: int
    next_seq: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStats]
    reproduced_files: int
    worker_pids: _containers.RepeatedScalarFieldContainer[int]
    disk_errors: int
    last_disk_error: str
    seqs_produced: int
    seqs_consumed: int
    seqs_quarantined: int
    seqs_missing: int
    curriculum: CurriculumStats
    mixture: MixtureStats
    journal_error: str
    worker_backoff_s: float
    last_worker_error: str
    tokens_per_s: float
    batches_per_s: float
    rate_window_s: float
    tokens_served: int
    tokens_per_file: int
    epochs: float
    epoch_eta_s: float
    worker_rss_bytes: _containers.RepeatedScalarFieldContainer[int]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerPlacement]
    def __init__(self, split: _Optional[str] = ..., produced_files: _Optional[int] = ..., consumed_files: _Optional[int] = ..., quarantined_files: _Optional[int] = ..., ready_files: _Optional[int] = ..., leased_files: _Optional[int] = ..., leases_expired: _Optional[int] = ..., produced_bytes: _Optional[int] = ..., worker_restarts: _Optional[int] = ..., max_backlog_files: _Optional[int] = ..., world_size: _Optional[int] = ..., next_seq: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStats, _Mapping]]] = ..., reproduced_files: _Optional[int] = ..., worker_pids: _Optional[_Iterable[int]] = ..., disk_errors: _Optional[int] = ..., last_disk_error: _Optional[str] = ..., seqs_produced: _Optional[int] = ..., seqs_consumed: _Optional[int] = ..., seqs_quarantined: _Optional[int] = ..., seqs_missing: _Optional[int] = ..., curriculum: _Optional[_Union[CurriculumStats, _Mapping]] = ..., mixture: _Optional[_Union[MixtureStats, _Mapping]] = ..., journal_error: _Optional[str] = ..., worker_backoff_s: _Optional[float] = ..., last_worker_error: _Optional[str] = ..., tokens_per_s: _Optional[float] = ..., batches_per_s: _Optional[float] = ..., rate_window_s: _Optional[float] = ..., tokens_served: _Optional[int] = ..., tokens_per_file: _Optional[int] = ..., epochs: _Optional[float] = ..., epoch_eta_s: _Optional[float] = ..., worker_rss_bytes: _Optional[_Iterable[int]] = ..., warnings: _Optional[_Iterable[str]] = ..., workers: _Optional[_Iterable[_Union[WorkerPlacement, _Mapping]]] = ...) -> None: ...

class WorkerPlacement(_message.Message):
    __slots__ = ("role", "index", "backend", "pid", "node_id", "restarts", "rss_bytes")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    role: str
    index: int
    backend: str
    pid: int
    node_id: str
    restarts: int
    rss_bytes: int
    def __init__(self, role: _Optional[str] = ..., index: _Optional[int] = ..., backend: _Optional[str] = ..., pid: _Optional[int] = ..., node_id: _Optional[str] = ..., restarts: _Optional[int] = ..., rss_bytes: _Optional[int] = ...) -> None: ...

class CurriculumStats(_message.Message):
    __slots__ = ("alpha", "kl_to_target", "buffer_batches", "served_tokens", "candidates_ingested", "candidates_culled", "candidate_files", "overrides")
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    KL_TO_TARGET_FIELD_NUMBER: _ClassVar[int]
    BUFFER_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_INGESTED_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_CULLED_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_FILES_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    alpha: float
    kl_to_target: float
    buffer_batches: int
    served_tokens: int
    candidates_ingested: int
    candidates_culled: int
    candidate_files: int
    overrides: int
    def __init__(self, alpha: _Optional[float] = ..., kl_to_target: _Optional[float] = ..., buffer_batches: _Optional[int] = ..., served_tokens: _Optional[int] = ..., candidates_ingested: _Optional[int] = ..., candidates_culled: _Optional[int] = ..., candidate_files: _Optional[int] = ..., overrides: _Optional[int] = ...) -> None: ...

class SetCurriculumRequest(_message.Message):
    __slots__ = ("dataset", "split", "alpha", "position_seq", "rank")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    POSITION_SEQ_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    split: str
    alpha: float
    position_seq: int
    rank: int
    def __init__(self, dataset: _Optional[str] = ..., split: _Optional[str] = ..., alpha: _Optional[float] = ..., position_seq: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class SetCurriculumResponse(_message.Message):
    __slots__ = ("effective_seq",)
    EFFECTIVE_SEQ_FIELD_NUMBER: _ClassVar[int]
    effective_seq: int
    def __init__(self, effective_seq: _Optional[int] = ...) -> None: ...

class SetMixtureRequest(_message.Message):
    __slots__ = ("dataset", "split", "weights", "reset", "position_seq", "rank")
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    POSITION_SEQ_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    split: str
    weights: _containers.ScalarMap[str, float]
    reset: bool
    position_seq: int
    rank: int
    def __init__(self, dataset: _Optional[str] = ..., split: _Optional[str] = ..., weights: _Optional[_Mapping[str, float]] = ..., reset: _Optional[bool] = ..., position_seq: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class StepRange(_message.Message):
    __slots__ = ("from_step", "to_step")
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    TO_STEP_FIELD_NUMBER: _ClassVar[int]
    from_step: int
    to_step: int
    def __init__(self, from_step: _Optional[int] = ..., to_step: _Optional[int] = ...) -> None: ...

class SkipStepsRequest(_message.Message):
    __slots__ = ("dataset", "split", "from_step", "to_step", "position_step", "position_seq", "rank", "list_only")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    TO_STEP_FIELD_NUMBER: _ClassVar[int]
    POSITION_STEP_FIELD_NUMBER: _ClassVar[int]
    POSITION_SEQ_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LIST_ONLY_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    split: str
    from_step: int
    to_step: int
    position_step: int
    position_seq: int
    rank: int
    list_only: bool
    def __init__(self, dataset: _Optional[str] = ..., split: _Optional[str] = ..., from_step: _Optional[int] = ..., to_step: _Optional[int] = ..., position_step: _Optional[int] = ..., position_seq: _Optional[int] = ..., rank: _Optional[int] = ..., list_only: _Optional[bool] = ...) -> None: ...

class SkipStepsResponse(_message.Message):
    __slots__ = ("skips",)
    SKIPS_FIELD_NUMBER: _ClassVar[int]
    skips: _containers.RepeatedCompositeFieldContainer[StepRange]
    def __init__(self, skips: _Optional[_Iterable[_Union[StepRange, _Mapping]]] = ...) -> None: ...

class ExplainStepRequest(_message.Message):
    __slots__ = ("dataset", "split", "rank", "world_size", "step", "seq", "offset", "batch_size")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    split: str
    rank: int
    world_size: int
    step: int
    seq: int
    offset: int
    batch_size: int
    def __init__(self, dataset: _Optional[str] = ..., split: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., step: _Optional[int] = ..., seq: _Optional[int] = ..., offset: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class RowProvenance(_message.Message):
    __slots__ = ("seq", "row", "source", "file", "token_offset", "document")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    row: int
    source: str
    file: str
    token_offset: int
    document: int
    def __init__(self, seq: _Optional[int] = ..., row: _Optional[int] = ..., source: _Optional[str] = ..., file: _Optional[str] = ..., token_offset: _Optional[int] = ..., document: _Optional[int] = ...) -> None: ...

class ExplainStepResponse(_message.Message):
    __slots__ = ("rows", "world_size", "batch_size")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[RowProvenance]
    world_size: int
    batch_size: int
    def __init__(self, rows: _Optional[_Iterable[_Union[RowProvenance, _Mapping]]] = ..., world_size: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class SetMixtureResponse(_message.Message):
    __slots__ = ("effective_seq",)
    EFFECTIVE_SEQ_FIELD_NUMBER: _ClassVar[int]
    effective_seq: int
    def __init__(self, effective_seq: _Optional[int] = ...) -> None: ...

class MixtureSourceStats(_message.Message):
    __slots__ = ("name", "index", "weight", "rows_served", "tokens_served", "share", "target_share", "window_share", "window_target_share", "epochs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ROWS_SERVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SERVED_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    TARGET_SHARE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SHARE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TARGET_SHARE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    name: str
    index: int
    weight: float
    rows_served: int
    tokens_served: int
    share: float
    target_share: float
    window_share: float
    window_target_share: float
    epochs: float
    def __init__(self, name: _Optional[str] = ..., index: _Optional[int] = ..., weight: _Optional[float] = ..., rows_served: _Optional[int] = ..., tokens_served: _Optional[int] = ..., share: _Optional[float] = ..., target_share: _Optional[float] = ..., window_share: _Optional[float] = ..., window_target_share: _Optional[float] = ..., epochs: _Optional[float] = ...) -> None: ...

class MixtureWeightChange(_message.Message):
    __slots__ = ("effective_seq", "origin", "weights")
    EFFECTIVE_SEQ_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    effective_seq: int
    origin: str
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, effective_seq: _Optional[int] = ..., origin: _Optional[str] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class MixtureStats(_message.Message):
    __slots__ = ("sources", "rows_served", "window_rows", "history")
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    ROWS_SERVED_FIELD_NUMBER: _ClassVar[int]
    WINDOW_ROWS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[MixtureSourceStats]
    rows_served: int
    window_rows: int
    history: _containers.RepeatedCompositeFieldContainer[MixtureWeightChange]
    def __init__(self, sources: _Optional[_Iterable[_Union[MixtureSourceStats, _Mapping]]] = ..., rows_served: _Optional[int] = ..., window_rows: _Optional[int] = ..., history: _Optional[_Iterable[_Union[MixtureWeightChange, _Mapping]]] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("dataset", "state", "last_error", "splits")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    state: str
    last_error: str
    splits: _containers.RepeatedCompositeFieldContainer[SplitStats]
    def __init__(self, dataset: _Optional[str] = ..., state: _Optional[str] = ..., last_error: _Optional[str] = ..., splits: _Optional[_Iterable[_Union[SplitStats, _Mapping]]] = ...) -> None: ...

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("dataset", "split", "rank", "world_size", "client_id", "seq", "wait_ms", "carried", "reacquire", "releases")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    CARRIED_FIELD_NUMBER: _ClassVar[int]
    REACQUIRE_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    split: str
    rank: int
    world_size: int
    client_id: str
    seq: int
    wait_ms: int
    carried: bool
    reacquire: bool
    releases: _containers.RepeatedCompositeFieldContainer[ReleaseLeaseRequest]
    def __init__(self, dataset: _Optional[str] = ..., split: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., client_id: _Optional[str] = ..., seq: _Optional[int] = ..., wait_ms: _Optional[int] = ..., carried: _Optional[bool] = ..., reacquire: _Optional[bool] = ..., releases: _Optional[_Iterable[_Union[ReleaseLeaseRequest, _Mapping]]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "dataset", "split", "seq", "path", "num_batches", "batch_size", "size_bytes", "crc32", "ttl_ms", "rank", "world_size", "released", "carries_releases", "skips")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    CARRIES_RELEASES_FIELD_NUMBER: _ClassVar[int]
    SKIPS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    dataset: str
    split: str
    seq: int
    path: str
    num_batches: int
    batch_size: int
    size_bytes: int
    crc32: int
    ttl_ms: int
    rank: int
    world_size: int
    released: _containers.RepeatedScalarFieldContainer[str]
    carries_releases: bool
    skips: _containers.RepeatedCompositeFieldContainer[StepRange]
    def __init__(self, lease_id: _Optional[str] = ..., dataset: _Optional[str] = ..., split: _Optional[str] = ..., seq: _Optional[int] = ..., path: _Optional[str] = ..., num_batches: _Optional[int] = ..., batch_size: _Optional[int] = ..., size_bytes: _Optional[int] = ..., crc32: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., released: _Optional[_Iterable[str]] = ..., carries_releases: _Optional[bool] = ..., skips: _Optional[_Iterable[_Union[StepRange, _Mapping]]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "client_id", "outcome", "reason", "waited_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    client_id: str
    outcome: ReleaseOutcome
    reason: str
    waited_s: float
    def __init__(self, lease_id: _Optional[str] = ..., client_id: _Optional[str] = ..., outcome: _Optional[_Union[ReleaseOutcome, str]] = ..., reason: _Optional[str] = ..., waited_s: _Optional[float] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewLeasesRequest(_message.Message):
    __slots__ = ("client_id", "lease_ids")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, client_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RenewLeasesResponse(_message.Message):
    __slots__ = ("lost_lease_ids", "ttl_ms")
    LOST_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lost_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    ttl_ms: int
    def __init__(self, lost_lease_ids: _Optional[_Iterable[str]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class FetchFileRequest(_message.Message):
    __slots__ = ("lease_id", "client_id", "max_chunk_bytes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    client_id: str
    max_chunk_bytes: int
    def __init__(self, lease_id: _Optional[str] = ..., client_id: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("offset_bytes", "data", "size_bytes", "crc32")
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    offset_bytes: int
    data: bytes
    size_bytes: int
    crc32: int
    def __init__(self, offset_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...
