"""The on-disk contract every part of batchqueue stands on: batch files (FORMAT.md beside
this), their checksums and stored forms, meta and schemas, and every path under the data root."""
