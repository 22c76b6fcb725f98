"""The server's configuration: ServerConfig and DatasetConfig parsed once from TOML and checked, listen addresses, served ranks, and a config back to plain tables."""

from pathlib import Path

# The config `queue-server` serves without --config: the stdlib_char dataset.
DEFAULT_CONFIG = Path(__file__).parent.with_name("default_config.toml")
