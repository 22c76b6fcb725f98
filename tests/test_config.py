"""Server config: malformed TOML is refused naming the key and value; valid configs load."""

from __future__ import annotations

import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from queue_client.errors import ConfigError
from queue_server.config.server import (
    DEFAULT_LISTEN,
    DatasetConfig,
    ServerConfig,
    load_config,
    parse_config,
    parse_listen,
)

GOOD_DATASET = """
[datasets.chars]
provider = "char_lm"
batch_size = 4
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# ---- malformed configs --------------------------------------------------------------------

MALFORMED = [
    pytest.param("[servr]\nlisten = '127.0.0.1:1'\n", ["servr"], id="unknown-top-level-table"),
    pytest.param("verbose = true\n", ["verbose"], id="unknown-top-level-key"),
    pytest.param("[server]\nport = 5\n", ["server.port"], id="unknown-server-key"),
    pytest.param(
        "[server]\nverbose = true\n", ["server.verbose"], id="server-verbose-not-configurable"
    ),
    pytest.param(
        "[server]\nconfig_dir = '.'\n",
        ["server.config_dir"],
        id="server-config_dir-not-configurable",
    ),
    pytest.param(
        GOOD_DATASET + "batchsize = 4\n", ["datasets.chars.batchsize"], id="unknown-dataset-key"
    ),
    pytest.param(GOOD_DATASET + "name = 'other'\n", ["datasets.chars.name"], id="dataset-name-key"),
    pytest.param(
        "[datasets.chars]\nbatch_size = 4\n", ["datasets.chars.provider"], id="missing-provider"
    ),
    pytest.param(
        "[datasets.chars]\nprovider = 'char_lm'\n",
        ["datasets.chars.batch_size"],
        id="missing-batch_size",
    ),
    pytest.param(
        "[datasets.chars]\nprovider = ''\nbatch_size = 4\n",
        ["datasets.chars.provider", "''"],
        id="empty-provider",
    ),
    pytest.param(
        "[datasets.chars]\nprovider = 5\nbatch_size = 4\n",
        ["datasets.chars.provider", "5"],
        id="int-provider",
    ),
    pytest.param(
        "[datasets.chars]\nprovider = 'char_lm'\nbatch_size = 0\n",
        ["datasets.chars.batch_size", "0"],
        id="batch_size-0",
    ),
    pytest.param(
        "[datasets.chars]\nprovider = 'char_lm'\nbatch_size = -2\n",
        ["datasets.chars.batch_size", "-2"],
        id="batch_size-negative",
    ),
    pytest.param(
        "[datasets.chars]\nprovider = 'char_lm'\nbatch_size = '12'\n",
        ["datasets.chars.batch_size", "'12'"],
        id="batch_size-string",
    ),
    pytest.param(
        "[datasets.chars]\nprovider = 'char_lm'\nbatch_size = true\n",
        ["datasets.chars.batch_size", "True"],
        id="batch_size-bool",
    ),
    pytest.param(
        "[datasets.chars]\nprovider = 'char_lm'\nbatch_size = 4.0\n",
        ["datasets.chars.batch_size", "4.0"],
        id="batch_size-float",
    ),
    pytest.param(
        GOOD_DATASET + "batches_per_file = 0\n",
        ["datasets.chars.batches_per_file", "0"],
        id="batches_per_file-0",
    ),
    pytest.param(GOOD_DATASET + "workers = 0\n", ["datasets.chars.workers", "0"], id="workers-0"),
    pytest.param(
        GOOD_DATASET + "max_lead = 0\n", ["datasets.chars.max_lead", "0"], id="max_lead-0"
    ),
    pytest.param(
        GOOD_DATASET + "max_backlog_files = 0\n",
        ["datasets.chars.max_backlog_files", "0"],
        id="max_backlog_files-0",
    ),
    pytest.param(
        GOOD_DATASET + "max_worker_restarts = -1\n",
        ["datasets.chars.max_worker_restarts", "-1"],
        id="max_worker_restarts-negative",
    ),
    pytest.param(GOOD_DATASET + "seed = 'x'\n", ["datasets.chars.seed", "'x'"], id="seed-string"),
    pytest.param(
        GOOD_DATASET + "mode = 'fast'\n", ["datasets.chars.mode", "'fast'"], id="mode-fast"
    ),
    pytest.param(GOOD_DATASET + "args = 5\n", ["datasets.chars.args", "5"], id="args-not-table"),
    pytest.param(
        "[server]\nlisten = 'nohost'\n", ["server.listen", "'nohost'"], id="listen-nohost"
    ),
    pytest.param(
        "[server]\nlisten = 'h:99999'\n", ["server.listen", "'h:99999'"], id="listen-port-too-big"
    ),
    pytest.param(
        "[server]\nlisten = 'unix:'\n", ["server.listen", "'unix:'"], id="listen-unix-no-path"
    ),
    pytest.param("[server]\nlisten = ':5'\n", ["server.listen", "':5'"], id="listen-no-host"),
    pytest.param("[server]\nlisten = 'h:'\n", ["server.listen", "'h:'"], id="listen-no-port"),
    pytest.param(
        "[server]\nlisten = 'h:-1'\n", ["server.listen", "'h:-1'"], id="listen-negative-port"
    ),
    pytest.param("[server]\nlisten = ''\n", ["server.listen", "''"], id="listen-empty"),
    pytest.param("[server]\nlisten = 5\n", ["server.listen", "5"], id="listen-int"),
    pytest.param("[server]\ndata_root = ''\n", ["server.data_root", "''"], id="data_root-empty"),
    pytest.param("[server]\ndata_root = 5\n", ["server.data_root", "5"], id="data_root-int"),
    pytest.param("[server]\nlease_ttl_s = 0\n", ["server.lease_ttl_s", "0"], id="lease_ttl_s-0"),
    pytest.param(
        "[server]\nacquire_wait_s = -1.5\n",
        ["server.acquire_wait_s", "-1.5"],
        id="acquire_wait_s-negative",
    ),
    pytest.param(
        "[server]\nunix_socket_mode = 0o1777\n",
        ["server.unix_socket_mode", "1023"],
        id="unix_socket_mode-too-big",
    ),
    pytest.param("[server]\nauth_token = ''\n", ["server.auth_token", "''"], id="auth_token-empty"),
    pytest.param("server = 5\n", ["server", "5"], id="server-not-table"),
    pytest.param("datasets = 5\n", ["datasets", "5"], id="datasets-not-table"),
    pytest.param("[datasets]\nchars = 5\n", ["datasets.chars", "5"], id="dataset-not-table"),
    pytest.param(
        '[datasets."../x"]\nprovider = "char_lm"\nbatch_size = 4\n',
        ["../x"],
        id="dataset-name-dotdot",
    ),
    pytest.param(
        '[datasets."a/b"]\nprovider = "char_lm"\nbatch_size = 4\n', ["a/b"], id="dataset-name-slash"
    ),
]


@pytest.mark.parametrize(("text", "needles"), MALFORMED)
def test_malformed_config_names_key_and_value(
    tmp_path: Path, text: str, needles: list[str]
) -> None:
    """Each malformed config raises ConfigError whose message names the key (and the value)."""
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


@pytest.mark.parametrize("key", ["lease_ttl_s", "acquire_wait_s"])
def test_boolean_durations_are_refused(tmp_path: Path, key: str) -> None:
    """`lease_ttl_s = true` is not a duration."""
    with pytest.raises(ConfigError, match=key):
        load_config(_write(tmp_path, f"[server]\n{key} = true\n"))


@pytest.mark.parametrize(
    "text",
    [
        "[server\nlisten = 1",
        "a = = 1",
        "[datasets.x]\nbatch_size = 4\nbatch_size = 5\n",
        "x = 'unterminated",
    ],
)
def test_invalid_toml_is_config_error(tmp_path: Path, text: str) -> None:
    """Invalid TOML raises ConfigError naming the file."""
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_missing_config_file_is_config_error(tmp_path: Path) -> None:
    """A config path that does not exist raises ConfigError naming it."""
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="cannot read config") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_duplicate_dataset_names_via_parse_config() -> None:
    """ServerConfig refuses two datasets with the same name."""
    d = DatasetConfig(name="a", provider="char_lm", batch_size=1)
    with pytest.raises(ConfigError, match="unique"):
        ServerConfig(datasets=(d, d))


# ---- valid configs ------------------------------------------------------------------------


def test_defaults(tmp_path: Path) -> None:
    """An empty file is a valid config: documented defaults, no datasets."""
    config = load_config(_write(tmp_path, ""))
    assert config.listen == DEFAULT_LISTEN
    assert config.data_root == tmp_path.resolve() / "data"
    assert config.config_dir == tmp_path.resolve()
    assert config.lease_ttl_s == 30.0
    assert config.acquire_wait_s == 10.0
    assert config.unix_socket_mode == 0o600
    assert config.auth_token is None
    assert config.datasets == ()


def test_dataset_defaults(tmp_path: Path) -> None:
    """A dataset with only provider and batch_size gets every documented default."""
    config = load_config(_write(tmp_path, GOOD_DATASET))
    d = config.dataset("chars")
    assert (d.name, d.provider, d.batch_size) == ("chars", "char_lm", 4)
    assert d.batches_per_file == 100
    assert d.max_backlog_files == 2
    assert d.seed == 1337
    assert d.workers == 1
    assert d.mode == "deterministic"
    assert d.max_lead == 4
    assert d.max_worker_restarts == 3
    assert d.args == {}
    with pytest.raises(KeyError):
        config.dataset("other")


def test_full_config(tmp_path: Path) -> None:
    """Every key given explicitly is kept, args included."""
    text = """
    [server]
    listen = "unix:/run/bq.sock"
    lease_ttl_s = 12.5
    acquire_wait_s = 3
    unix_socket_mode = 0o660
    auth_token = "secret"

    [datasets.a]
    provider = "pkg.mod:Cls"
    batch_size = 8
    batches_per_file = 10
    max_backlog_files = 5
    seed = -7
    workers = 3
    mode = "best_effort"
    max_lead = 2
    max_worker_restarts = 0

    [datasets.a.args]
    block_size = 64
    input = "text.txt"

    [datasets.b]
    provider = "char_lm"
    batch_size = 1
    """
    config = load_config(_write(tmp_path, text))
    assert config.listen == "unix:/run/bq.sock"
    assert config.lease_ttl_s == 12.5
    assert config.acquire_wait_s == 3
    assert config.unix_socket_mode == 0o660
    assert config.auth_token == "secret"
    assert [d.name for d in config.datasets] == ["a", "b"]
    a = config.dataset("a")
    assert (a.batches_per_file, a.max_backlog_files, a.seed, a.workers) == (10, 5, -7, 3)
    assert (a.mode, a.max_lead, a.max_worker_restarts) == ("best_effort", 2, 0)
    assert a.args == {"block_size": 64, "input": "text.txt"}


def test_data_root_is_relative_to_config_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative data_root resolves against the config file's directory, not the cwd."""
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = _write(conf_dir, '[server]\ndata_root = "sub/data"\n')
    config = load_config(Path("..") / "conf" / path.name)
    assert config.data_root == conf_dir.resolve() / "sub" / "data"
    assert config.config_dir == conf_dir.resolve()


def test_absolute_data_root_is_kept(tmp_path: Path) -> None:
    """An absolute data_root is used as given."""
    root = tmp_path / "abs_root"
    config = load_config(_write(tmp_path, f'[server]\ndata_root = "{root.as_posix()}"\n'))
    assert config.data_root == root


def test_parse_config_directly() -> None:
    """parse_config takes already-parsed TOML and a config dir."""
    config = parse_config(
        {"datasets": {"d": {"provider": "p", "batch_size": 2, "args": {"k": [1, 2]}}}},
        config_dir=Path("cfg"),
    )
    assert config.data_root == Path("cfg") / "data"
    assert config.dataset("d").args == {"k": [1, 2]}


def test_load_default_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_config(None) loads the embedded default: stdlib_char via char_lm, data under cwd."""
    monkeypatch.chdir(tmp_path)
    config = load_config(None)
    assert [d.name for d in config.datasets] == ["stdlib_char"]
    d = config.dataset("stdlib_char")
    assert d.provider == "char_lm"
    assert d.batch_size == 12
    assert d.args == {"block_size": 256}
    assert config.listen == DEFAULT_LISTEN
    assert parse_listen(config.listen).is_loopback
    assert config.data_root == Path.cwd() / "data"


# ---- listen addresses ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("listen", "host", "port", "unix", "target"),
    [
        ("127.0.0.1:0", "127.0.0.1", 0, None, "127.0.0.1:0"),
        ("[::1]:5", "[::1]", 5, None, "[::1]:5"),
        ("localhost:65535", "localhost", 65535, None, "localhost:65535"),
        ("unix:/tmp/x.sock", None, None, "/tmp/x.sock", "unix:/tmp/x.sock"),
        ("unix:rel.sock", None, None, "rel.sock", "unix:rel.sock"),
    ],
)
def test_parse_listen(
    listen: str, host: str | None, port: int | None, unix: str | None, target: str
) -> None:
    """HOST:PORT, [v6]:PORT and unix:PATH parse into their parts and back to a gRPC target."""
    addr = parse_listen(listen)
    assert (addr.host, addr.port, addr.unix_path) == (host, port, unix)
    assert addr.grpc_target == target


def test_listen_with_non_ascii_digit_port_is_config_error() -> None:
    """A port spelled with a superscript digit is a config error, not a crash."""
    with pytest.raises(ConfigError, match=r"server\.listen"):
        parse_listen("h:\u00b2")


@pytest.mark.parametrize(
    ("listen", "loopback"),
    [
        ("127.0.0.1:1", True),
        ("127.1.2.3:1", True),
        ("[::1]:1", True),
        ("localhost:1", True),
        ("unix:/tmp/x.sock", True),
        ("0.0.0.0:1", False),
        ("10.1.2.3:1", False),
        ("[::]:1", False),
        ("example.com:1", False),
    ],
)
def test_is_loopback(listen: str, loopback: bool) -> None:
    """Only loopback IPs, 'localhost' and unix sockets count as loopback."""
    assert parse_listen(listen).is_loopback is loopback


# ---- fingerprint --------------------------------------------------------------------------

BASE = DatasetConfig(name="d", provider="char_lm", batch_size=4, args={"block_size": 8})


@pytest.mark.parametrize(
    "change",
    [
        {"batch_size": 5},
        {"seed": 1},
        {"args": {"block_size": 9}},
        {"args": {"block_size": 8, "input": "x.txt"}},
        {"args": {"block_size": "8"}},
        {"args": {}},
        {"provider": "other"},
        {"batches_per_file": 7},
        {"workers": 2},
    ],
)
def test_fingerprint_changes_with_what_data_depends_on(change: dict) -> None:
    """Changing anything the produced data depends on changes the fingerprint."""
    assert replace(BASE, **change).fingerprint() != BASE.fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"name": "renamed"},
        {"max_backlog_files": 9},
        {"mode": "best_effort"},
        {"max_lead": 1},
        {"max_worker_restarts": 0},
        {"worker_priority": "idle"},
        {"args": {"block_size": 8}},
    ],
)
def test_fingerprint_ignores_what_data_does_not_depend_on(change: dict) -> None:
    """Scheduling knobs, the name and an equal args dict leave the fingerprint unchanged."""
    assert replace(BASE, **change).fingerprint() == BASE.fingerprint()


def test_fingerprint_ignores_args_order() -> None:
    """The same args in another order give the same fingerprint."""
    a = replace(BASE, args={"x": 1, "y": {"p": 1, "q": 2}})
    b = replace(BASE, args={"y": {"q": 2, "p": 1}, "x": 1})
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 16
