import sys

from queue_server.entry import main

sys.exit(main())
