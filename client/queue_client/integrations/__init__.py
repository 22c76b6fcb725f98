"""Wiring for training frameworks. Each module imports its framework, so `import queue_client`
never does: import the one you use (queue_client.integrations.lightning, .hf_trainer,
.torchtitan).

Each keeps every rank's QueueClient state in the framework's own checkpoint, so a resume reads
exactly the rows an uninterrupted run would, also at another data-parallel size."""
