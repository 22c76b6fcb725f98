"""How the server and its worker processes log: one line format, and who speaks without -v.

batchqueue's own loggers (`queue_server.*`, `queue_providers.*`) log at INFO always: what the
server serves, where it listens, how far a long preparation got, and that it stopped. Other
libraries stay at WARNING unless -v, and one line per produced file needs -v as well.
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
OWN_LOGGERS = ("queue_server", "queue_providers")


def configure_logging(verbose: bool = False) -> None:
    """Lines to stderr in LOG_FORMAT: batchqueue's at INFO, everyone else's at WARNING
    (INFO with `verbose`)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format=LOG_FORMAT)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
