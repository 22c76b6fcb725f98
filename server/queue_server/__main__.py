import sys

from queue_server.cli import main

sys.exit(main())
