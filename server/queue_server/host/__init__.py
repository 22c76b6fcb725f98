"""The server process on its host: one server per data root, its unix socket and TCP ports,
ending with its parent, and temp files of stopped workers swept."""
