"""The one exception the text pipeline adds: a fault in the corpus itself."""

from __future__ import annotations

from queue_client.errors import BatchQueueError


class CorpusError(BatchQueueError, ValueError):
    """The corpus holds something the provider cannot read: a JSONL line that is not JSON, a
    missing text key, invalid UTF-8 under utf8_errors="error", a document larger than
    max_document_bytes, or no documents at all. The message names the file and the line or
    byte offset; fix the data (or the option named) and restart. Files already published
    stay valid: a file is written only once all its batches were built."""
