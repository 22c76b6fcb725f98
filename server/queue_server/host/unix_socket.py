"""Taking a unix socket path over only when it is a stale socket.

A server killed with SIGKILL leaves its socket file behind, and binding fails while a file is
there, so a stale socket must be removed first. The path may also be another live server's
socket, or a file that is no socket at all: those are refused, never deleted. "Stale" is
decided the only reliable way: a connect that the kernel refuses because nobody listens.

FIXME: two servers started at the same moment on one path can both find it stale, and the
second removes the first's fresh socket; the data root lock keeps them off each other's files.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat

# A live server accepts at once; this only bounds a listener whose backlog is full.
_PROBE_TIMEOUT_S = 1.0


def claim_socket_path(path: str) -> None:
    """Make `path` free to bind: remove it if it is a socket nobody listens on.

    Raises OSError naming the path when it is a live socket, not a socket, or cannot be probed.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(
            f"cannot listen on unix:{path}: {path} exists and is not a socket; "
            "remove it yourself or choose another path"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_PROBE_TIMEOUT_S)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # stale: its server died without removing it
        return
    except FileNotFoundError:
        return  # removed meanwhile
    except (TimeoutError, BlockingIOError):
        pass  # a listener with a full backlog is alive
    except OSError as exc:
        raise OSError(
            f"cannot listen on unix:{path}: cannot tell whether the socket there is in use "
            f"({exc.strerror}); remove it yourself or choose another path"
        ) from None
    finally:
        probe.close()
    raise OSError(
        f"cannot listen on unix:{path}: another server is listening on that socket; "
        "stop it or choose another path"
    )


def socket_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the socket at `path`, to remove it later only if it is still ours."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def remove_socket(path: str, identity: tuple[int, int] | None) -> None:
    """Remove the socket this server bound at `path`, unless something else is there now."""
    if identity is not None and socket_identity(path) == identity:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
