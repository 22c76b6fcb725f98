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

import os
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from queue_client.errors import ConfigError
from queue_server.config import DEFAULT_CONFIG
from queue_server.config.checks import check, in_range, is_int
from queue_server.config.dataset import (  # noqa: F401  (the config's public names, in one place)
    BACKENDS,
    CURRICULUM_KEYS,
    DATASET_KEYS,
    MODES,
    SELECTIONS,
    CurriculumConfig,
    DatasetConfig,
    dataset_from_table,
    parse_ray_placement,
)
from queue_server.config.listen import ListenAddress, parse_listen  # noqa: F401
from queue_server.config.served_ranks import EVERY_RANK, ServedRanks, spec_text
from queue_server.config.served_ranks import resolve as resolve_ranks
from queue_server.steering.store import parse_address

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_LISTEN = "127.0.0.1:50051"


# Upper bounds, in seconds: a day of lease without renewal, an hour in one AcquireLease call.
MAX_LEASE_TTL_S = 86_400.0
MAX_ACQUIRE_WAIT_S = 3_600.0
# FetchFile streams open at once: far more than one server's ranks ever fetch together.
MAX_FETCH_STREAMS = 65_536
MAX_SNAPSHOT_RECORDS = 1 << 30


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
    # PEM certificate (chain) and private key: with both, the TCP listener speaks TLS only.
    # Relative to the config file; read when the server starts.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # The global ranks this server makes files for: "all" (one server for the whole job), a
    # list such as [0, 1] or "0-3" (a TOML array is kept as "0,1"), or "launcher": this node's
    # share, from torchrun's environment. A server per node writes only its ranks' files.
    ranks: str = "all"
    # The world those ranks belong to: needed with a list of ranks; with "launcher", 0 reads
    # WORLD_SIZE (or NNODES x LOCAL_WORLD_SIZE); with "all", the world size production starts
    # from before any client asks (0: one rank until then).
    world_size: int = 0
    # The job's control plane, where the servers of one job share every steering change
    # (SetMixture, SetCurriculum) so that it takes effect at the same row on each
    # (docs/multi-node.md): "tcpstore://HOST:PORT", a torch.distributed TCPStore such as
    # torchrun's MASTER_ADDR:MASTER_PORT; "" (the default): this server steers alone.
    control_plane: str = ""
    # The store's keys are under batchqueue/<control_namespace>/: one namespace per job that
    # shares a store with others.
    control_namespace: str = "default"
    # Records of a split's control log between its snapshots: a server that joins reads the
    # latest snapshot and the records after it, not the whole log (steering/log.py).
    control_snapshot_records: int = 4096
    # A dataset that fails (config, inputs, provider) stops the server with exit code 2;
    # true keeps the others serving and reports the failed one NOT_SERVING with its reason.
    keep_serving: bool = False
    # FetchFile streams open at once, server-wide; one more is RESOURCE_EXHAUSTED. Each holds
    # a few chunks of memory (rpc/file_stream.py), so this bounds what streams hold in all.
    max_fetch_streams: int = 64
    # Where relative provider paths are resolved (the config file's directory).
    config_dir: Path = Path(".")
    verbose: bool = False
    datasets: tuple[DatasetConfig, ...] = ()
    # ranks and world_size resolved (the launcher's environment read once, here).
    served: ServedRanks = field(default=EVERY_RANK, init=False, compare=False)

    def __post_init__(self) -> None:
        parse_listen(self.listen)
        check(
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
        check(
            in_range(self.lease_ttl_s, 0.1, MAX_LEASE_TTL_S),
            "server.lease_ttl_s",
            self.lease_ttl_s,
            f"a number of seconds in [0.1, {MAX_LEASE_TTL_S:g}]",
        )
        check(
            in_range(self.acquire_wait_s, 0.001, MAX_ACQUIRE_WAIT_S),
            "server.acquire_wait_s",
            self.acquire_wait_s,
            f"a number of seconds in [0.001, {MAX_ACQUIRE_WAIT_S:g}]",
        )
        check(
            is_int(self.unix_socket_mode) and 0 <= self.unix_socket_mode <= 0o777,
            "server.unix_socket_mode",
            self.unix_socket_mode,
            "a file mode such as 0o600",
        )
        check(
            self.auth_token is None or (isinstance(self.auth_token, str) and self.auth_token != ""),
            "server.auth_token",
            self.auth_token,
            "a non-empty string",
        )
        self._check_tls()
        check(
            isinstance(self.keep_serving, bool),
            "server.keep_serving",
            self.keep_serving,
            "true or false",
        )
        check(
            is_int(self.max_fetch_streams) and 1 <= self.max_fetch_streams <= MAX_FETCH_STREAMS,
            "server.max_fetch_streams",
            self.max_fetch_streams,
            f"an integer in [1, {MAX_FETCH_STREAMS}]",
        )
        check(
            isinstance(self.control_plane, str), "server.control_plane", self.control_plane,
            'tcpstore://HOST:PORT or ""',
        )  # fmt: skip
        if self.control_plane:
            parse_address(self.control_plane, "server.control_plane")
        check(
            isinstance(self.control_namespace, str)
            and re.fullmatch(r"[A-Za-z0-9._-]{1,64}", self.control_namespace) is not None,
            "server.control_namespace",
            self.control_namespace,
            "1-64 letters, digits, '.', '_' or '-'",
        )
        check(
            is_int(self.control_snapshot_records)
            and 1 <= self.control_snapshot_records <= MAX_SNAPSHOT_RECORDS,
            "server.control_snapshot_records",
            self.control_snapshot_records,
            f"an integer in [1, {MAX_SNAPSHOT_RECORDS}]",
        )
        names = [d.name for d in self.datasets]
        check(len(set(names)) == len(names), "datasets", names, "unique names")
        self._check_ranks()

    def _check_ranks(self) -> None:
        """Resolve `ranks`; node-local serving needs datasets whose files a node can make
        on its own (docs/multi-node.md): not best effort, where any rank takes any file. A
        curriculum is composed per stream (curriculum_streams), each node its ranks' streams."""
        object.__setattr__(self, "ranks", spec_text(self.ranks))
        served = resolve_ranks(self.ranks, self.world_size, os.environ)
        object.__setattr__(self, "served", served)
        if served.all:
            return
        for d in self.datasets:
            if d.mode != "deterministic":
                raise ConfigError(
                    f"server.ranks = {self.ranks!r} cannot serve datasets.{d.name}, which has "
                    f"mode = {d.mode!r}: in best-effort mode any rank takes any file, so the "
                    'nodes would make the same files. Use mode = "deterministic"'
                )

    def _check_tls(self) -> None:
        for key in ("tls_cert_file", "tls_key_file"):
            value = getattr(self, key)
            check(
                value is None or (isinstance(value, (str, Path)) and str(value) != ""),
                f"server.{key}",
                value,
                "the path of a PEM file",
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            given, missing = (
                ("tls_cert_file", "tls_key_file")
                if self.tls_key_file is None
                else ("tls_key_file", "tls_cert_file")
            )
            raise ConfigError(
                f"server.{given} is set but server.{missing} is not: TLS needs both the "
                "certificate and its private key"
            )
        if self.tls_cert_file is not None and parse_listen(self.listen).unix_path:
            raise ConfigError(
                f"server.tls_cert_file is set but server.listen = {self.listen!r} is a unix "
                "socket: TLS is for TCP listeners (a socket file is guarded by "
                "server.unix_socket_mode); listen on HOST:PORT or drop the TLS keys"
            )

    def dataset(self, name: str) -> DatasetConfig:
        for d in self.datasets:
            if d.name == name:
                return d
        raise KeyError(name)


_SERVER_KEYS = {f.name for f in fields(ServerConfig)} - {
    "datasets",
    "config_dir",
    "verbose",
    "served",
}


def parse_config(raw: dict[str, Any], *, config_dir: Path) -> ServerConfig:
    """Build a ServerConfig from parsed TOML, naming the first offending key."""
    unknown = sorted(set(raw) - {"server", "datasets"})
    if unknown:
        raise ConfigError(
            f"unknown top-level table(s) {unknown}: expected [server] and [datasets.NAME]"
        )
    server = raw.get("server", {})
    check(isinstance(server, dict), "server", server, "a table")
    unknown = sorted(set(server) - _SERVER_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {['server.' + k for k in unknown]}: expected some of {sorted(_SERVER_KEYS)}"
        )
    datasets_raw = raw.get("datasets", {})
    check(isinstance(datasets_raw, dict), "datasets", datasets_raw, "tables [datasets.NAME]")
    datasets = []
    for name, table in datasets_raw.items():
        check(isinstance(table, dict), f"datasets.{name}", table, "a table")
        datasets.append(dataset_from_table(name, table))
    kwargs = dict(server)
    if "data_root" in kwargs:
        check(
            isinstance(kwargs["data_root"], str) and kwargs["data_root"] != "",
            "server.data_root",
            kwargs["data_root"],
            "a path",
        )
        kwargs["data_root"] = config_dir / Path(kwargs["data_root"]).expanduser()
    else:
        kwargs["data_root"] = config_dir / "data"
    for key in ("tls_cert_file", "tls_key_file"):
        if isinstance(kwargs.get(key), str) and kwargs[key]:
            kwargs[key] = str(config_dir / Path(kwargs[key]).expanduser())
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
