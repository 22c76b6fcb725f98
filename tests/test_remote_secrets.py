"""A pre-signed URL's secrets never reach text, whatever encoding a client library writes them
in: a real HTTP server (a thread here, on loopback) answers 401, 403 and 503 to a URL that
carries an X-Amz-Security-Token with '/', '+' and '=' in it, and real queue-server processes
fail on it. The token, the signature and the credential appear in none of: the server's log,
the exit message, GetStats' last_error, the unauthenticated /healthz. And the credential-key
filter of storage_options refuses secrets and accepts what is not one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

import pytest
from support.object_http import ObjectServer

from conftest import subprocess_env, wait_until
from queue_client.errors import ConfigError
from queue_providers.remote import RemoteSettings, is_secret_key, redact, scrub
from queue_server.testing import ServerProcess

TOKEN = "IQoJb3JpZ2luX2VjEJr/Zq9Tk+Lp4Xv8w=Hs/Qe7Rm+Wn2Ky5B=="
SIGNATURE = "9f0e1d2c3b4a59687766554433221100aabbccddeeff0011"
KEY_ID = "ASIAQBATCHQTEST7"
QUERY = (
    "X-Amz-Algorithm=AWS4-HMAC-SHA256"
    f"&X-Amz-Credential={quote(f'{KEY_ID}/20260101/us-east-1/s3/aws4_request', safe='')}"
    "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600"
    f"&X-Amz-Security-Token={quote(TOKEN, safe='')}"
    f"&X-Amz-SignedHeaders=host&X-Amz-Signature={SIGNATURE}"
)
STATUSES = {"unauthorized": 401, "forbidden": 403, "unavailable": 503}


def secret_forms() -> set[str]:
    """Each secret in every encoding a client may write it in, and each run of the token
    between its '/', '+' and '=' (the same in any encoding)."""
    forms = {SIGNATURE, KEY_ID}
    for secret in (TOKEN, f"{KEY_ID}/20260101"):
        forms |= {secret, quote(secret, safe=""), quote(secret), quote_plus(secret)}
    forms |= {part for part in re.split(r"[/+=]", TOKEN) if len(part) >= 6}
    return forms


def assert_no_secret(where: str, text: str) -> None:
    for form in secret_forms():
        assert form not in text, f"{form!r} is in the {where}: {text[:2000]}"


def dataset(name: str, url: str) -> str:
    return textwrap.dedent(
        f"""
        [datasets.{name}]
        provider = "text_lm"
        batch_size = 2
        workers = 1
        max_worker_restarts = 0
        [datasets.{name}.args]
        source = {json.dumps(url)}
        seq_len = 32
        micro_batch_size = 2
        remote = {{ retry_seconds = 2, attempts = 3 }}
        """
    )


def get(address: str, path: str) -> str:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as reply:
            return reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.read().decode()


@pytest.fixture(scope="module")
def refusing() -> Any:
    """One HTTP server; each dataset's object is answered with its own status."""
    files = {f"{name}.jsonl": b'{"text": "x"}\n' for name in STATUSES}
    with ObjectServer(files) as http:
        http.status_of.update({f"{name}.jsonl": code for name, code in STATUSES.items()})
        yield http


def test_a_presigned_token_is_in_no_log_stats_or_healthz_when_its_endpoint_refuses(
    refusing: ObjectServer, tmp_path: Path
) -> None:
    """--keep-serving, three datasets whose endpoints answer 401, 403 and 503: each fails with
    the status in its last_error, and the token is in no log line, last_error or /healthz."""
    text = "".join(dataset(n, f"{refusing.url(f'{n}.jsonl')}?{QUERY}") for n in STATUSES)
    server = ServerProcess(
        tmp_path / "server",
        data_root=tmp_path / "data",
        config_text=text,
        args=("--keep-serving",),
        env=subprocess_env(),
    )
    try:
        server.wait_bound(60)
        errors = wait_until(
            lambda: (
                all(server.stats(n)["state"] == "failed" for n in STATUSES)
                and {n: server.stats(n)["last_error"] for n in STATUSES}
            ),
            90,
            "every dataset to fail",
        )
        healthz = get(server.metrics_address, "/healthz")
    finally:
        server.stop()
    assert any(TOKEN[:19] in path for _, path, _ in refusing.requests)  # the token was sent
    for name, code in STATUSES.items():
        assert f"the server answered {code}" in errors[name], errors[name]
        shown = redact(f"{refusing.url(f'{name}.jsonl')}?{QUERY}")
        assert f"input {shown!r}" in errors[name], errors[name]
        assert_no_secret(f"last_error of {name}", errors[name])
    assert all(name in healthz for name in STATUSES), healthz
    assert_no_secret("/healthz", healthz)
    assert_no_secret("server log", server.log())


@pytest.mark.parametrize(
    "name",
    [
        "forbidden",
        # The same message path as 403 (one process start each): with the long soaks.
        pytest.param("unauthorized", marks=pytest.mark.slow),
        pytest.param("unavailable", marks=pytest.mark.slow),
    ],
)
def test_a_presigned_token_is_not_in_the_exit_message(
    refusing: ObjectServer, tmp_path: Path, name: str
) -> None:
    """Without --keep-serving the start ends with exit code 2, and its message names the URL
    (query values as ***) and the status, but holds no secret."""
    config = tmp_path / "config.toml"
    config.write_text(dataset(name, f"{refusing.url(f'{name}.jsonl')}?{QUERY}"))
    proc = subprocess.run(
        [sys.executable, "-m", "queue_server", "--config", str(config),
         "--data-root", str(tmp_path / "data"), "--listen", "127.0.0.1:0",
         "--metrics-listen", ""],
        capture_output=True, text=True, timeout=120, env=subprocess_env(), cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert f"the server answered {STATUSES[name]}" in out, out
    assert "X-Amz-Security-Token=***" in out, out
    assert_no_secret("exit message", out)


def test_scrub_finds_secrets_a_client_rewrote() -> None:
    """aiohttp and yarl decode %2F to '/' and may re-quote the rest; botocore quotes again.
    Whatever form the URL took, the secrets go and the host and path stay."""
    url = f"https://bucket.example.com/data/c.jsonl?{QUERY}"
    decoded = url.replace(quote(TOKEN, safe=""), TOKEN)
    for message in (
        f"503, message='Service Unavailable', url=URL('{decoded}')",
        f"403 Forbidden for url: {url.replace('%2F', '/')}",
        f"GET {decoded.replace('+', '%2B').replace('=', '%3D')} failed",
        f"token was {TOKEN!r}, encoded {quote_plus(TOKEN)}",
        f"signature {SIGNATURE} rejected",
    ):
        shown = scrub(message, url)
        assert_no_secret("scrubbed message", shown)
    assert "bucket.example.com/data/c.jsonl?" in scrub(f"at {decoded}", url)


# A table: each storage_options key, and whether it names a secret.
KEYS = [
    ("key", True),
    ("secret", True),
    ("token", True),
    ("password", True),
    ("passphrase", True),
    ("pw", True),
    ("db_pw", True),
    ("sas", True),
    ("sas_token", True),
    ("connection_string", True),
    ("connectionString", True),
    ("account_key", True),
    ("client_secret", True),
    ("aws_session_token", True),
    ("Authorization", True),
    ("signature", True),
    ("private_key_id", True),
    ("cookie", True),
    ("signature_version", False),
    ("endpoint_url", False),
    ("anon", False),
    ("region_name", False),
    ("requester_pays", False),
    ("version_aware", False),
    ("client_kwargs", False),
    ("config_kwargs", False),
    ("skip_instance_cache", False),
    ("default_block_size", False),
    ("project", False),
    ("account_name", False),
]


@pytest.mark.parametrize(("key", "secret"), KEYS)
def test_storage_options_refuse_secrets_and_take_the_rest(key: str, secret: bool) -> None:
    assert is_secret_key(key) is secret
    options = {"config_kwargs": {key: "s3v4-or-a-value"}}  # nested: the same rule at any depth
    table = {"storage_options": options}
    if secret:
        with pytest.raises(ConfigError, match=rf"\.{re.escape(key)} looks like a credential"):
            RemoteSettings.from_config(table, cache_dir=None, who="text_lm")
    else:
        settings = RemoteSettings.from_config(table, cache_dir=None, who="text_lm")
        assert settings.storage_options == options
