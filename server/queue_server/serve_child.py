"""serve()'s child process: `python -m queue_server.serve_child --spec SPEC.json ...`.

The workers' forkserver starts before anything else is imported, as for `queue-server`
(entry.py): its torch import then runs beside this process's own imports, and the first
batch of a serve() block comes as soon as a `queue-server` launch's. The rest is
inprocess.child_main.
"""

from __future__ import annotations

import sys

from queue_server.entry import prepare_server_process


def main() -> int:
    prepare_server_process()
    from queue_server.inprocess import child_main

    return child_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
