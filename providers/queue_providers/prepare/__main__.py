"""`python -m queue_providers.prepare`: the same as `queue-prepare`."""

import sys

from queue_providers.prepare.cli import main

if __name__ == "__main__":
    sys.exit(main())
