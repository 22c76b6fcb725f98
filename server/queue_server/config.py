"""Server config: TOML parsed once at the entry point into frozen, self-validating dataclasses.

```toml
[server]
listen = "127.0.0.1:50051"     # or "unix:/path/to/sock"
data_root = "./data"

[datasets.NAME]
provider = "char_lm"
batch_size = 12
[datasets.NAME.args]           # the provider's own keyword arguments
block_size = 256
```

Relative paths (data_root, and provider args, which workers resolve from their working
directory) are relative to the config file's directory. Errors name the key, the value and
what was expected.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from queue_client.batchfile import check_dataset_name
from queue_client.errors import ConfigError, InvalidRequest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_CONFIG = Path(__file__).with_name("default_config.toml")
MODES = ("deterministic", "best_effort")
SELECTIONS = ("fifo", "curriculum")


def _check(cond: bool, key: str, value: Any, expected: str) -> None:
    if not cond:
        raise ConfigError(f"{key} = {value!r} is invalid: expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class DatasetConfig:
    """One [datasets.NAME] table."""

    name: str
    provider: str
    batch_size: int
    # Batches per file: big enough that the per-file lease RPC is amortised over many steps.
    batches_per_file: int = 100
    # Ready files kept ahead of each rank beyond the two it holds (the one it reads and the
    # prefetched next); production pauses at this depth and a release resumes it.
    max_backlog_files: int = 2
    seed: int = 1337
    # Worker processes per split; worker w produces seqs w, w+workers, ...
    workers: int = 1
    # "deterministic": rank r of W reads seqs r, r+W, ...; "best_effort": any rank takes the
    # next ready file, at most max_lead files ahead of the slowest rank.
    mode: str = "deterministic"
    max_lead: int = 4
    # Worker crashes (process death or a raised error) in a row before the dataset is failed.
    max_worker_restarts: int = 3
    # "fifo": files are served as produced; "curriculum": each served batch is picked from a
    # buffer of candidates by token neglect against an alpha-blended target (docs/curriculum.md).
    selection: str = "fifo"
    # Curriculum: candidate batches in the buffer, and candidates ingested per served batch.
    candidate_buffer: int = 1000
    candidate_oversample: float = 2.0
    # Curriculum: alpha of target = (1 - alpha) * corpus + alpha * uniform, before any schedule
    # point or SetCurriculum call; a schedule is a list of [x, alpha] points over
    # curriculum_schedule_unit ("step": batches per rank, or "tokens": tokens served).
    curriculum_alpha: float = 1.0
    curriculum_schedule: list[list[float]] = field(default_factory=list)
    curriculum_schedule_unit: str = "step"
    # Curriculum: tokens sampled (spread over all of the data) to estimate the corpus distribution.
    starting_estimation_token_count: int = 10_000_000
    # Curriculum: the batch field whose token ids are scored ("" picks the meta's token_field,
    # else "x" or "input_ids").
    curriculum_field: str = ""
    # Curriculum: the splits it applies to; the others (val) are served as produced.
    curriculum_splits: list[str] = field(default_factory=lambda: ["train"])
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"datasets.{self.name}"
        try:
            check_dataset_name(self.name)
        except InvalidRequest as exc:
            raise ConfigError(f"[{where}]: {exc}") from None
        _check(
            isinstance(self.provider, str) and bool(self.provider),
            f"{where}.provider",
            self.provider,
            "a provider name such as 'char_lm'",
        )
        for key in ("batch_size", "batches_per_file", "max_backlog_files", "workers", "max_lead"):
            value = getattr(self, key)
            _check(_is_int(value) and value >= 1, f"{where}.{key}", value, "an integer >= 1")
        _check(_is_int(self.seed), f"{where}.seed", self.seed, "an integer")
        _check(
            _is_int(self.max_worker_restarts) and self.max_worker_restarts >= 0,
            f"{where}.max_worker_restarts",
            self.max_worker_restarts,
            "an integer >= 0",
        )
        _check(self.mode in MODES, f"{where}.mode", self.mode, f"one of {MODES}")
        _check(isinstance(self.args, dict), f"{where}.args", self.args, "a table")
        self._check_curriculum(where)

    def _check_curriculum(self, where: str) -> None:
        from queue_server.curriculum.schedule import UNITS, check_points

        _check(
            self.selection in SELECTIONS,
            f"{where}.selection",
            self.selection,
            f"one of {SELECTIONS}",
        )
        if self.selection == "curriculum" and self.mode != "deterministic":
            raise ConfigError(
                f'{where}.selection = "curriculum" needs mode = "deterministic" (it is {self.mode!r}): '
                "served batches are composed in seq order"
            )
        _check(
            _is_int(self.candidate_buffer) and self.candidate_buffer >= 1,
            f"{where}.candidate_buffer",
            self.candidate_buffer,
            "an integer >= 1",
        )
        _check(
            _is_number(self.candidate_oversample) and self.candidate_oversample >= 1,
            f"{where}.candidate_oversample",
            self.candidate_oversample,
            "a number >= 1",
        )
        _check(
            _is_number(self.curriculum_alpha) and 0 <= self.curriculum_alpha <= 1,
            f"{where}.curriculum_alpha",
            self.curriculum_alpha,
            "a number in [0, 1]",
        )
        check_points(self.curriculum_schedule, f"{where}.curriculum_schedule")
        _check(
            self.curriculum_schedule_unit in UNITS,
            f"{where}.curriculum_schedule_unit",
            self.curriculum_schedule_unit,
            f"one of {UNITS}",
        )
        _check(
            _is_int(self.starting_estimation_token_count)
            and self.starting_estimation_token_count >= 1,
            f"{where}.starting_estimation_token_count",
            self.starting_estimation_token_count,
            "an integer >= 1",
        )
        _check(
            isinstance(self.curriculum_splits, list)
            and bool(self.curriculum_splits)
            and all(isinstance(x, str) and x for x in self.curriculum_splits),
            f"{where}.curriculum_splits",
            self.curriculum_splits,
            'a non-empty list of split names such as ["train"]',
        )
        _check(
            isinstance(self.curriculum_field, str),
            f"{where}.curriculum_field",
            self.curriculum_field,
            "a field name",
        )

    def fingerprint(self) -> str:
        """What the produced data depends on; a dataset dir built under another is refused."""
        keyed = {
            "provider": self.provider,
            "batch_size": self.batch_size,
            "batches_per_file": self.batches_per_file,
            "seed": self.seed,
            "workers": self.workers,
            "args": self.args,
        }
        if self.selection != "fifo":  # what is served depends on these too
            keyed["curriculum"] = [
                self.selection,
                self.candidate_buffer,
                self.candidate_oversample,
                self.curriculum_alpha,
                self.curriculum_schedule,
                self.curriculum_schedule_unit,
                self.starting_estimation_token_count,
                self.curriculum_field,
                self.curriculum_splits,
            ]
        return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[
            :16
        ]


@dataclass(frozen=True)
class ServerConfig:
    """The [server] table plus every dataset."""

    listen: str = DEFAULT_LISTEN
    data_root: Path = Path("data")
    # A client renews its leases every third of this; a dead client's files return after it.
    lease_ttl_s: float = 30.0
    # The longest one AcquireLease call waits before DEADLINE_EXCEEDED; clients call again.
    acquire_wait_s: float = 10.0
    # Mode of the unix socket file, when listening on one.
    unix_socket_mode: int = 0o600
    # HTTP /metrics (Prometheus) and /healthz; "" turns it off.
    metrics_listen: str = "127.0.0.1:50052"
    # Required in an "authorization: Bearer <token>" header when set.
    auth_token: str | None = None
    # Where relative provider paths are resolved (the config file's directory).
    config_dir: Path = Path(".")
    verbose: bool = False
    datasets: tuple[DatasetConfig, ...] = ()

    def __post_init__(self) -> None:
        parse_listen(self.listen)
        _check(
            isinstance(self.metrics_listen, str),
            "server.metrics_listen",
            self.metrics_listen,
            'HOST:PORT, unix:PATH or "" for off',
        )
        if self.metrics_listen:
            try:
                parse_listen(self.metrics_listen)
            except ConfigError:
                raise ConfigError(
                    f'server.metrics_listen = {self.metrics_listen!r} is invalid: expected HOST:PORT, unix:PATH or "" for off'
                ) from None
        _check(
            _is_number(self.lease_ttl_s) and self.lease_ttl_s > 0,
            "server.lease_ttl_s",
            self.lease_ttl_s,
            "a number > 0",
        )
        _check(
            _is_number(self.acquire_wait_s) and self.acquire_wait_s > 0,
            "server.acquire_wait_s",
            self.acquire_wait_s,
            "a number > 0",
        )
        _check(
            _is_int(self.unix_socket_mode) and 0 <= self.unix_socket_mode <= 0o777,
            "server.unix_socket_mode",
            self.unix_socket_mode,
            "a file mode such as 0o600",
        )
        _check(
            self.auth_token is None or (isinstance(self.auth_token, str) and self.auth_token != ""),
            "server.auth_token",
            self.auth_token,
            "a non-empty string",
        )
        names = [d.name for d in self.datasets]
        _check(len(set(names)) == len(names), "datasets", names, "unique names")

    def dataset(self, name: str) -> DatasetConfig:
        for d in self.datasets:
            if d.name == name:
                return d
        raise KeyError(name)


@dataclass(frozen=True)
class ListenAddress:
    """Where the server listens: host and port, or a unix socket path."""

    host: str | None
    port: int | None
    unix_path: str | None

    @property
    def grpc_target(self) -> str:
        return f"unix:{self.unix_path}" if self.unix_path else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.unix_path:
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback  # type: ignore[union-attr]
        except ValueError:
            return False


def parse_listen(listen: str) -> ListenAddress:
    """ "HOST:PORT", "[::1]:PORT" or "unix:PATH"; port 0 picks a free port."""
    if not isinstance(listen, str) or not listen:
        raise ConfigError(f"server.listen = {listen!r} is invalid: expected HOST:PORT or unix:PATH")
    if listen.startswith("unix:"):
        path = listen[len("unix:") :]
        _check(bool(path), "server.listen", listen, "unix:PATH with a path")
        return ListenAddress(None, None, path)
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ConfigError(
            f"server.listen = {listen!r} is invalid: expected HOST:PORT (port 0-65535) or unix:PATH"
        )
    return ListenAddress(host, int(port), None)


_SERVER_KEYS = {f.name for f in fields(ServerConfig)} - {"datasets", "config_dir", "verbose"}
_DATASET_KEYS = {f.name for f in fields(DatasetConfig)} - {"name"}


def parse_config(raw: dict[str, Any], *, config_dir: Path) -> ServerConfig:
    """Build a ServerConfig from parsed TOML, naming the first offending key."""
    unknown = sorted(set(raw) - {"server", "datasets"})
    if unknown:
        raise ConfigError(
            f"unknown top-level table(s) {unknown}: expected [server] and [datasets.NAME]"
        )
    server = raw.get("server", {})
    _check(isinstance(server, dict), "server", server, "a table")
    unknown = sorted(set(server) - _SERVER_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {['server.' + k for k in unknown]}: expected some of {sorted(_SERVER_KEYS)}"
        )
    datasets_raw = raw.get("datasets", {})
    _check(isinstance(datasets_raw, dict), "datasets", datasets_raw, "tables [datasets.NAME]")
    datasets = []
    for name, table in datasets_raw.items():
        _check(isinstance(table, dict), f"datasets.{name}", table, "a table")
        unknown = sorted(set(table) - _DATASET_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown key(s) {[f'datasets.{name}.{k}' for k in unknown]}: expected some of {sorted(_DATASET_KEYS)}"
            )
        for key in ("provider", "batch_size"):
            if key not in table:
                raise ConfigError(f"datasets.{name}.{key} is missing")
        datasets.append(DatasetConfig(name=name, **table))
    kwargs = dict(server)
    if "data_root" in kwargs:
        _check(
            isinstance(kwargs["data_root"], str) and kwargs["data_root"] != "",
            "server.data_root",
            kwargs["data_root"],
            "a path",
        )
        kwargs["data_root"] = config_dir / Path(kwargs["data_root"]).expanduser()
    else:
        kwargs["data_root"] = config_dir / "data"
    return ServerConfig(**kwargs, config_dir=config_dir, datasets=tuple(datasets))


def load_config(path: Path | None) -> ServerConfig:
    """Read a TOML config file (the embedded default when path is None)."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    config_dir = Path.cwd() if path == DEFAULT_CONFIG else path.resolve().parent
    return parse_config(raw, config_dir=config_dir)
