"""The server's configuration: ServerConfig and DatasetConfig parsed once from TOML and checked, listen addresses, served ranks, and a config back to plain tables."""
