"""queue_client: what a training script imports to read batches from a batchqueue server."""
