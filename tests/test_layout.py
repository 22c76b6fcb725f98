"""The data root's layout: every path named in queue_client.format.layout, no name that leaves the
root, temp names that say whose they are, and atomic_write / atomic_directory on real files.
The last section scans the source so that no other module builds such a path by hand."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, subprocess_env
from queue_client.errors import InvalidRequest
from queue_client.format.batchfile import BatchFileName
from queue_client.format.layout import (
    DatasetLayout,
    artifact_array_file,
    artifact_info_file,
    atomic_directory,
    atomic_write,
    check_dataset_name,
    check_split_name,
    composer_snapshot_name,
    composer_snapshot_seq,
    fsync_dir,
    is_temp_name,
    is_temp_of,
    reason_file,
    remove_temp_files,
    root_lock_file,
    temp_owner_pid,
    temp_path,
)

# ---- dataset and split names --------------------------------------------------------------

BAD_NAMES = [
    "..",
    "../x",
    "/abs",
    "a/b",
    "",
    "a\x00b",
    "\x00",
    "x" * 129,
    ".hidden",
    "a..b",
    "-x",
    "a b",
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_check_dataset_name_rejects(name: str) -> None:
    """Names that could leave the data root, or are malformed, raise InvalidRequest."""
    with pytest.raises(InvalidRequest, match="not allowed"):
        check_dataset_name(name)


@pytest.mark.parametrize("name", [None, 5, b"abc"])
def test_check_dataset_name_rejects_non_strings(name: object) -> None:
    """Only str names are accepted."""
    with pytest.raises(InvalidRequest):
        check_dataset_name(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["stdlib_char", "a", "A.b-c_1", "shakespeare-char.v2", "x" * 128])
def test_check_dataset_name_accepts_normal_names(name: str) -> None:
    """Ordinary names (up to 128 chars) are returned unchanged."""
    assert check_dataset_name(name) == name


@pytest.mark.parametrize("name", [*BAD_NAMES, "a.b", "x" * 65])
def test_check_split_name_rejects(name: str) -> None:
    """Split names allow no dots or slashes and at most 64 characters."""
    with pytest.raises(InvalidRequest, match="not allowed"):
        check_split_name(name)


@pytest.mark.parametrize("name", ["train", "val", "test-2", "A_b", "x" * 64])
def test_check_split_name_accepts_normal_names(name: str) -> None:
    """Ordinary split names are returned unchanged."""
    assert check_split_name(name) == name


@pytest.mark.parametrize("check", [check_dataset_name, check_split_name])
def test_names_with_trailing_newline_are_rejected(check: Callable[[str], str]) -> None:
    """A trailing newline is not one of the allowed characters."""
    with pytest.raises(InvalidRequest):
        check("train\n")


def test_a_long_rejected_name_is_clipped_in_the_message() -> None:
    """The error names the value, but never echoes a megabyte back."""
    with pytest.raises(InvalidRequest) as info:
        check_dataset_name("/" * 1_000_000)
    assert len(str(info.value)) < 400
    assert "1000002 characters" in str(info.value)


# ---- every path kind ----------------------------------------------------------------------

ROOT_DIR = Path("data_root")
LAYOUT = DatasetLayout(ROOT_DIR, "ds")
SNAPSHOT = "composer-0000000007.npz"

# Each kind of path, built from one untrusted name; str results are '/'-separated relative paths.
PATH_KINDS: dict[str, Callable[[str], Path | str]] = {
    "dataset": lambda n: DatasetLayout(ROOT_DIR, n).dir,
    "queue_dir": LAYOUT.queue_dir,
    "candidates_dir": LAYOUT.candidates_dir,
    "files_dir": LAYOUT.files_dir,
    "files_dir(candidates)": lambda n: LAYOUT.files_dir(n, candidates=True),
    "quarantine_dir": LAYOUT.quarantine_dir,
    "quarantine_dir(candidates)": lambda n: LAYOUT.quarantine_dir(n, candidates=True),
    "journal_file": LAYOUT.journal_file,
    "journal_file(candidates)": lambda n: LAYOUT.journal_file(n, candidates=True),
    "corpus_cache_file": LAYOUT.corpus_cache_file,
    "composer_snapshot_dir": LAYOUT.composer_snapshot_dir,
    "composer_snapshot_file(split)": lambda n: LAYOUT.composer_snapshot_file(n, SNAPSHOT),
    "composer_snapshot_file(name)": lambda n: LAYOUT.composer_snapshot_file("train", n),
    "artifacts": LAYOUT.artifacts,
    "artifact_array_file": lambda n: artifact_array_file(LAYOUT.artifacts("k"), n),
    "leased_path(split)": lambda n: LAYOUT.leased_path(n, "f.pt"),
    "leased_path(file)": lambda n: LAYOUT.leased_path("train", n),
}
LEAVING = ["..", "../x", "/abs", "a/b", "a/../../x", "", "a\x00b", ".", "./x", "x/"]


@pytest.mark.parametrize("name", LEAVING)
@pytest.mark.parametrize("kind", sorted(PATH_KINDS))
def test_names_that_would_leave_the_root_are_refused_for_every_path_kind(
    kind: str, name: str
) -> None:
    """No accessor joins a name with '/', '..' or NUL in it: each raises InvalidRequest."""
    with pytest.raises(InvalidRequest):
        PATH_KINDS[kind](name)


_name_text = st.text(alphabet=st.sampled_from("ab.-_/\x00Z9 \\"), max_size=12)


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(sorted(PATH_KINDS)), name=st.one_of(_name_text, st.text(max_size=20)))
def test_every_accepted_name_stays_inside_the_dataset_dir(kind: str, name: str) -> None:
    """Whatever a name holds, a path built from it is refused or lies inside its dataset dir."""
    try:
        path = PATH_KINDS[kind](name)
    except InvalidRequest:
        return
    if isinstance(path, str):  # leased_path: relative to the data root
        path = ROOT_DIR / path
    normalized = Path(os.path.normpath(path))
    if kind == "dataset":
        assert normalized.parent == ROOT_DIR and normalized.name == name, (name, path)
        return
    home = ROOT_DIR / "ds"
    assert normalized != home and normalized.is_relative_to(home), (kind, name, path)


def test_paths_follow_the_documented_layout() -> None:
    """Each accessor gives the path FORMAT.md documents."""
    ds = ROOT_DIR / "ds"
    assert LAYOUT.dir == ds
    assert LAYOUT.meta_file == ds / "meta.pkl"
    assert LAYOUT.queue_dir("train") == ds / "queue" / "train"
    assert LAYOUT.candidates_dir("train") == ds / "candidates" / "train"
    assert LAYOUT.files_dir("train") == LAYOUT.queue_dir("train")
    assert LAYOUT.files_dir("train", candidates=True) == LAYOUT.candidates_dir("train")
    assert LAYOUT.curriculum_dir == ds / "curriculum"
    assert LAYOUT.corpus_cache_file("0123abc") == ds / "curriculum" / "corpus-0123abc.npy"
    assert LAYOUT.composer_snapshot_dir("train") == ds / "curriculum" / "train"
    assert (
        LAYOUT.composer_snapshot_file("train", SNAPSHOT) == ds / "curriculum" / "train" / SNAPSHOT
    )
    assert LAYOUT.artifacts("key-1") == ds / "artifacts" / "key-1"
    assert artifact_info_file(LAYOUT.artifacts("key-1")) == ds / "artifacts" / "key-1" / "info.json"
    assert artifact_array_file(LAYOUT.artifacts("k"), "ids") == ds / "artifacts" / "k" / "ids.npy"
    assert LAYOUT.tokenizer_dir == ds / "tokenizer"
    assert LAYOUT.leased_path("train", "f.pt") == "ds/queue/train/f.pt"
    assert root_lock_file(ROOT_DIR) == ROOT_DIR / ".batchqueue.lock"


def test_journal_and_quarantine_paths_of_a_split_and_of_its_candidates() -> None:
    """A split's candidates have their own journal and quarantine, never another split's."""
    ds = ROOT_DIR / "ds"
    assert LAYOUT.journal_dir == ds / "journal"
    assert LAYOUT.journal_file("train") == ds / "journal" / "train.jsonl"
    assert (
        LAYOUT.journal_file("train", candidates=True) == ds / "journal" / "train.candidates.jsonl"
    )
    assert LAYOUT.quarantine_dir("val") == ds / "quarantine" / "val"
    assert LAYOUT.quarantine_dir("val", candidates=True) == ds / "quarantine" / "val" / "candidates"
    # A split named "candidates" keeps its own dirs, and no split can be named like a
    # candidates journal (split names hold no dot).
    assert LAYOUT.quarantine_dir("candidates") == ds / "quarantine" / "candidates"
    assert LAYOUT.quarantine_dir("candidates") != LAYOUT.quarantine_dir("train", candidates=True)
    with pytest.raises(InvalidRequest):
        LAYOUT.journal_file("train.candidates")


def test_reason_file_sits_beside_the_quarantined_file() -> None:
    quarantined = LAYOUT.quarantine_dir("train") / "1700000000123-0000000042-100.pt"
    assert reason_file(quarantined) == quarantined.parent / (quarantined.name + ".reason.txt")


def test_layout_takes_a_str_root_and_is_frozen() -> None:
    layout = DatasetLayout("r", "ds")  # type: ignore[arg-type]
    assert layout.root == Path("r") and layout.dir == Path("r") / "ds"
    with pytest.raises(AttributeError):
        layout.dataset = "other"  # type: ignore[misc]


@pytest.mark.parametrize("seq", [0, 7, 9_999_999_999, 12_345_678_901])
def test_composer_snapshot_names_round_trip(seq: int) -> None:
    name = composer_snapshot_name(seq)
    assert composer_snapshot_seq(name) == seq
    assert LAYOUT.composer_snapshot_file("train", name).name == name


@pytest.mark.parametrize(
    "name",
    ["composer-7.npz", "composer-0000000007.npz.tmp", ".tmp-1-0-composer-0000000007.npz", "x"],
)
def test_other_names_are_not_composer_snapshots(name: str) -> None:
    assert composer_snapshot_seq(name) is None
    with pytest.raises(InvalidRequest, match="composer snapshot name"):
        LAYOUT.composer_snapshot_file("train", name)


# ---- temp names ---------------------------------------------------------------------------


def test_temp_path_is_a_hidden_unique_sibling_marked_with_our_pid(tmp_path: Path) -> None:
    final = tmp_path / "1700000000123-0000000042-100.pt"
    one, two = temp_path(final), temp_path(final)
    assert one != two
    for tmp in (one, two):
        assert tmp.parent == final.parent
        assert tmp.name.startswith(f".tmp-{os.getpid()}-")
        assert tmp.name.endswith(final.name)
        assert is_temp_name(tmp.name)
        assert is_temp_of(tmp.name, os.getpid())
        assert temp_owner_pid(tmp.name) == os.getpid()
        assert BatchFileName.parse(tmp.name) is None  # readers never see it as a batch file


@pytest.mark.parametrize(
    ("name", "pid", "theirs"),
    [
        (".tmp-123-0-f.pt", 123, True),
        (".tmp-123-0-f.pt", 12, False),  # a pid that is a prefix of another is not it
        (".tmp-12-0-f.pt", 123, False),
        (".tmp-123-0-f.pt", 1230, False),
        ("123-0-f.pt", 123, False),
    ],
)
def test_is_temp_of_matches_the_whole_pid(name: str, pid: int, theirs: bool) -> None:
    assert is_temp_of(name, pid) is theirs


@pytest.mark.parametrize(
    ("name", "pid"),
    [(".tmp-4242-7-meta.pkl", 4242), (".tmp-a.pt", None), ("meta.pkl", None), (".tmp-9-x", None)],
)
def test_temp_owner_pid(name: str, pid: int | None) -> None:
    assert temp_owner_pid(name) == pid


def test_temp_names_of_two_processes_never_collide(tmp_path: Path) -> None:
    """Another process names its temp files by its own pid, so it never meets ours."""
    final = tmp_path / "meta.pkl"
    code = "import sys, os; from pathlib import Path; from queue_client.format.layout import temp_path;"
    code += "print(os.getpid(), temp_path(Path(sys.argv[1])).name)"
    out = subprocess.run(
        [sys.executable, "-c", code, str(final)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    child_pid, child_name = int(out[0]), out[1]
    assert child_pid != os.getpid()
    assert is_temp_of(child_name, child_pid) and not is_temp_of(child_name, os.getpid())
    assert child_name != temp_path(final).name


def _litter(directory: Path, other_pid: int) -> None:
    (directory / "1700000000123-0000000001-5.pt").write_bytes(b"published")
    (directory / "notes.txt").write_bytes(b"kept")
    (directory / "tmp-not-hidden.pt").write_bytes(b"kept")
    temp_path(directory / "mine.pt").write_bytes(b"partial")
    (directory / f".tmp-{other_pid}-0-theirs.pt").write_bytes(b"partial")
    (directory / f".tmp-{other_pid}-1-artifacts").mkdir()
    (directory / f".tmp-{other_pid}-1-artifacts" / "x.npy").write_bytes(b"partial")
    (directory / ".tmp-old-style.pt").write_bytes(b"partial")


def test_remove_temp_files_of_one_pid_leaves_the_others(tmp_path: Path) -> None:
    """With a pid, only that process's temp files and temp dirs go."""
    other = os.getpid() + 1
    _litter(tmp_path, other)
    assert remove_temp_files(tmp_path, other) == 2
    left = sorted(os.listdir(tmp_path))
    assert not [n for n in left if is_temp_of(n, other)]
    assert sum(is_temp_of(n, os.getpid()) for n in left) == 1
    assert ".tmp-old-style.pt" in left
    assert remove_temp_files(tmp_path, other) == 0


def test_remove_temp_files_without_pid_removes_every_temp_and_nothing_else(tmp_path: Path) -> None:
    _litter(tmp_path, os.getpid() + 1)
    assert remove_temp_files(tmp_path) == 4
    assert sorted(os.listdir(tmp_path)) == [
        "1700000000123-0000000001-5.pt",
        "notes.txt",
        "tmp-not-hidden.pt",
    ]
    assert remove_temp_files(tmp_path) == 0


def test_remove_temp_files_of_a_missing_dir_is_zero(tmp_path: Path) -> None:
    assert remove_temp_files(tmp_path / "absent") == 0
    assert remove_temp_files(tmp_path / "absent", 1) == 0


# ---- atomic_write -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_atomic_write_of_bytes_leaves_the_file_and_no_temp(tmp_path: Path, kind: type) -> None:
    target = tmp_path / "meta.pkl"
    atomic_write(target, kind(b"first"))
    assert target.read_bytes() == b"first"
    atomic_write(target, kind(b"second, longer"))
    assert target.read_bytes() == b"second, longer"
    assert os.listdir(tmp_path) == ["meta.pkl"]


def test_atomic_write_with_a_writer_callback(tmp_path: Path) -> None:
    target = tmp_path / "corpus-k.npy"

    def write(f) -> None:
        f.write(b"head-")
        f.write(b"tail")

    atomic_write(target, write)
    assert target.read_bytes() == b"head-tail"
    assert os.listdir(tmp_path) == ["corpus-k.npy"]


@pytest.mark.parametrize("existed", [True, False])
def test_a_failing_writer_leaves_the_old_content_and_no_temp(tmp_path: Path, existed: bool) -> None:
    """The writer's error propagates; the target is as it was, and the temp file is gone."""
    target = tmp_path / "meta.pkl"
    if existed:
        target.write_bytes(b"old content")

    def write(f) -> None:
        f.write(b"half of the new con")
        raise ValueError("the writer failed")

    with pytest.raises(ValueError, match="the writer failed"):
        atomic_write(target, write)
    assert os.listdir(tmp_path) == (["meta.pkl"] if existed else [])
    if existed:
        assert target.read_bytes() == b"old content"


def test_a_writer_killed_mid_write_leaves_the_old_content(tmp_path: Path) -> None:
    """SIGKILL between write and rename: the target keeps its old bytes, and the temp file
    left behind is the dead process's, which remove_temp_files(dir, pid) clears."""
    target = tmp_path / "meta.pkl"
    target.write_bytes(b"old content")
    code = textwrap.dedent(
        """
        import sys
        from queue_client.format.layout import atomic_write

        def write(f):
            f.write(b"half of the new con")
            f.flush()
            print("writing", flush=True)
            sys.stdin.read()  # blocks until killed

        atomic_write(sys.argv[1], write)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(target)],
        env=subprocess_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "writing\n"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
    assert target.read_bytes() == b"old content"
    temps = [n for n in os.listdir(tmp_path) if is_temp_name(n)]
    assert len(temps) == 1 and is_temp_of(temps[0], child.pid)
    assert remove_temp_files(tmp_path, child.pid) == 1
    assert os.listdir(tmp_path) == ["meta.pkl"]


def test_fsync_dir_on_a_real_directory(tmp_path: Path) -> None:
    """fsync of a directory works here (it is what makes a rename durable)."""
    before = os.stat(tmp_path)
    fsync_dir(tmp_path)
    assert os.stat(tmp_path).st_ino == before.st_ino
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "absent")


# ---- atomic_directory ---------------------------------------------------------------------


def test_atomic_directory_publishes_once_and_a_second_builder_gets_none(tmp_path: Path) -> None:
    final = tmp_path / "artifacts" / "key-1"
    with atomic_directory(final) as building:
        assert building is not None and building != final
        assert is_temp_of(building.name, os.getpid()) and building.parent == final.parent
        assert not final.exists()
        atomic_write(artifact_info_file(building), b'{"n": 1}')
    assert artifact_info_file(final).read_bytes() == b'{"n": 1}'
    assert os.listdir(final.parent) == ["key-1"]
    with atomic_directory(final) as again:
        assert again is None
    assert os.listdir(final) == ["info.json"]


def test_a_failing_builder_publishes_nothing_and_leaves_no_temp(tmp_path: Path) -> None:
    final = tmp_path / "artifacts" / "key-1"
    with pytest.raises(RuntimeError, match="tokenizer exploded"):
        with atomic_directory(final) as building:
            assert building is not None
            atomic_write(building / "part.npy", b"partial")
            raise RuntimeError("tokenizer exploded")
    assert not final.exists()
    assert os.listdir(final.parent) == []


def test_of_two_builders_at_once_the_first_to_finish_wins(tmp_path: Path) -> None:
    """Both start before either finishes; the second's rename fails on the published dir, so
    its temp dir is dropped and the first one's content stays."""
    final = tmp_path / "key-1"
    with atomic_directory(final) as first:
        with atomic_directory(final) as second:
            assert first is not None and second is not None and first != second
            atomic_write(first / "who", b"first")
            atomic_write(second / "who", b"second")
        assert (final / "who").read_bytes() == b"second"  # the inner one finished first
    assert (final / "who").read_bytes() == b"second"
    assert os.listdir(tmp_path) == ["key-1"]


# ---- the guard: nothing else builds a data-root path by string arithmetic -----------------

SOURCE_ROOTS = ("client", "server", "providers")
LAYOUT_MODULE = Path("client/queue_client/format/layout.py")

# (file, the flagged expression as written) -> why it may stay. Keep this short: a path
# under the data root belongs in layout.py, not here.
ALLOWED: dict[tuple[str, str], str] = {
    (
        "client/queue_client/integrations/hf_trainer.py",
        'Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"',
    ): "the Hugging Face Trainer's own checkpoint folder, named as the Trainer names it; "
    "outside the data root",
    (
        "server/queue_server/production/ray/ray_probe.py",
        'Path.home() / ".ray"',
    ): "Ray's own token file in the user's home, read as Ray reads it; outside the data root",
    (
        "server/queue_server/production/ray/ray_probe.py",
        'Path.home() / ".ray" / "auth_token"',
    ): "Ray's own token file in the user's home, read as Ray reads it; outside the data root",
    (
        "server/queue_server/config/__init__.py",
        'Path(__file__).parent.with_name("default_config.toml")',
    ): "the packaged default config beside its module, not under the data root",
    (
        "server/queue_server/config/server.py",
        'config_dir / "data"',
    ): "the default data root itself, beside the config file: the root, not a path under it",
    (
        "providers/queue_providers/nanogpt_bin.py",
        'self.data_dir / "meta.pkl"',
    ): "nanoGPT's prepared input dir (args.data_dir), read as input; outside the data root",
    (
        "providers/queue_providers/nanogpt_bin.py",
        'self.data_dir / f"{split}.bin"',
    ): "nanoGPT's train.bin/val.bin input files; outside the data root",
    (
        "providers/queue_providers/token_shards/megatron.py",
        'path.with_suffix(".bin")',
    ): "a Megatron dataset's .bin input file beside its .idx; outside the data root",
    (
        "providers/queue_providers/token_shards/megatron.py",
        'path.with_suffix(".idx")',
    ): "a Megatron dataset's .idx input file beside its .bin; outside the data root",
}


def _is_text(node: ast.expr) -> bool:
    """A str literal, an f-string, a str.format() call, or + / % arithmetic on one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "format" and _is_text(node.func.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return _is_text(node.left) or _is_text(node.right)
    return False


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return f"{_call_name(func.value)}.{func.attr}"
    return ""


def path_arithmetic(source: str) -> list[tuple[int, str, str]]:
    """(line, expression, rule) for every path that `source` builds out of strings."""
    found = []
    for node in ast.walk(ast.parse(source)):
        rule = None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            if _is_text(node.left) or _is_text(node.right):
                rule = "'/' with a string operand"
        elif isinstance(node, ast.Call):
            name = _call_name(node.func)
            if name.endswith((".with_name", ".with_suffix")):
                rule = f"{name.rsplit('.', 1)[1]}()"
            elif name in ("os.path.join", "path.join", "join") and any(map(_is_text, node.args)):
                rule = "os.path.join() with a string"
            elif name in ("Path", "pathlib.Path", "PurePath") and node.args:
                if _is_text(node.args[0]) and not isinstance(node.args[0], ast.Constant):
                    rule = "Path() of formatted text"
        if rule is not None:
            found.append((node.lineno, ast.get_source_segment(source, node) or "?", rule))
    return sorted(found)


def _sources() -> list[Path]:
    files = []
    for top in SOURCE_ROOTS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel == LAYOUT_MODULE or (rel.parent.name == "wire" and "_pb2" in rel.name):
                continue
            files.append(rel)
    return files


def _offenders() -> tuple[list[str], set[tuple[str, str]]]:
    offenders, used = [], set()
    for rel in _sources():
        for line, expr, rule in path_arithmetic((ROOT / rel).read_text(encoding="utf-8")):
            key = (rel.as_posix(), expr)
            if key in ALLOWED:
                used.add(key)
            else:
                offenders.append(f"{rel.as_posix()}:{line}: {expr}  ({rule})")
    return offenders, used


def test_no_module_builds_a_data_root_path_by_string_arithmetic() -> None:
    """Every path under the data root comes from queue_client.format.layout."""
    offenders, _ = _offenders()
    assert not offenders, (
        f"{len(offenders)} path(s) built by string arithmetic outside queue_client/format/layout.py; "
        "name them in layout.py (DatasetLayout, temp_path, atomic_write), or, for a path "
        "outside the data root, add it to ALLOWED in this file with the reason:\n  "
        + "\n  ".join(offenders)
    )


def test_every_allowed_exception_is_still_there() -> None:
    """An allowance whose code is gone is removed, so the list stays the justified few."""
    _, used = _offenders()
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries that match nothing any more, remove them: {stale}"


@pytest.mark.parametrize(
    ("code", "rule"),
    [
        ('p = root / "queue" / split', "'/' with a string operand"),
        ('p = root / f"{split}.jsonl"', "'/' with a string operand"),
        ('p = root / "{}.jsonl".format(split)', "'/' with a string operand"),
        ('p = root / (name + ".tmp")', "'/' with a string operand"),
        ('p = root / ("%s.tmp" % name)', "'/' with a string operand"),
        ('p = "data" / root', "'/' with a string operand"),
        ('p = os.path.join(root, "journal")', "os.path.join() with a string"),
        ("p = path.with_name(name)", "with_name()"),
        ('p = path.with_suffix(".tmp")', "with_suffix()"),
        ('p = Path(f"{root}/{dataset}")', "Path() of formatted text"),
    ],
)
def test_the_guard_catches_each_kind_of_string_path(code: str, rule: str) -> None:
    """The scan really flags each shape it is meant to refuse, on the line it is on."""
    found = path_arithmetic("import os\n" + code + "\n")
    assert found and found[0][0] == 2 and found[0][2] == rule, found


@pytest.mark.parametrize(
    "code",
    [
        "p = layout.queue_dir(split)",
        "p = directory / str(name)",
        "p = root / name",
        "n = total / 2",
        'p = Path("config.toml")',
        "p = os.path.join(root, name)",
        'label = "a" + name',
    ],
)
def test_the_guard_lets_layout_calls_and_arithmetic_pass(code: str) -> None:
    assert path_arithmetic(code) == []
