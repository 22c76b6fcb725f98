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
    prepare_server_process(preload_torch=_spec_needs_torch(sys.argv[1:]))
    from queue_server.inprocess import child_main

    return child_main(sys.argv[1:])


def _spec_needs_torch(args: list[str]) -> bool:
    """Whether the workers of the spec's config need torch preloaded (worker_imports.py)."""
    import json
    from pathlib import Path

    from queue_server.production.worker_imports import tables_need_torch

    try:
        spec = json.loads(Path(args[args.index("--spec") + 1]).read_text(encoding="utf-8"))
        return tables_need_torch(spec["tables"])
    except (ValueError, IndexError, KeyError, TypeError, OSError):
        return True  # child_main reports what is wrong with the spec


if __name__ == "__main__":
    sys.exit(main())
