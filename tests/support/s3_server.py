"""A real S3-compatible server for the tests: moto's server mode, in a process of its own.

    server = S3Server.start(log_path)
    server.client().create_bucket(Bucket="corpus")
    ...  # s3://corpus/... with storage_options.endpoint_url = server.endpoint
    server.stop()

The server speaks the S3 REST protocol on a free port of 127.0.0.1, so s3fs and boto3 talk to
it exactly as to a remote store. It accepts any credentials; CREDENTIALS are the ones the tests
give the queue-server's environment, distinctive enough to search the server's output for.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from queue_server.testing import wait_until

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "BQTESTKEYID4821",
    "AWS_SECRET_ACCESS_KEY": "bq-test-secret-7f3a9c1e55d24b08",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# Credentials are looked up nowhere else: not in ~/.aws, not at an instance metadata endpoint.
NO_AMBIENT_CREDENTIALS = {
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """moto.server on 127.0.0.1:port; its output goes to `log_path`."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.endpoint = f"http://127.0.0.1:{port}"

    @classmethod
    def start(cls, log_path: Path, timeout_s: float = 30.0) -> S3Server:
        port = free_port()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        server = cls(proc, port, log_path)
        wait_until(server._answers, timeout_s, f"moto S3 server on port {port} to answer")
        return server

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"moto server exited with {self.proc.returncode}: {self.log_path.read_text()}"
            )
        try:
            with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1):
                return True
        except (urllib.error.URLError, OSError):
            return False

    def client(self) -> Any:
        """A boto3 S3 client of this server, with the test credentials."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        )

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
