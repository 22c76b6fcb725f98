"""The parts of the text_lm provider, one job per module.

corpus.py says which files make the corpus (files.py for `source`, local or remote, or a
Hugging Face dataset), readers.py turns a byte or row range of one file into documents
(separated.py for text split by separator lines, records.py for JSONL and Parquet, reading.py
for what they share), plan.py cuts the corpus into train/val ranges and per-worker chunks,
tokenizer.py maps text to ids (byte, char, hf; tiktoken_tokenizer.py for tiktoken) and keeps
the snapshot, packing.py cuts token streams into [T] windows, and stream.py ties them into one
split's resumable stream of windows.
"""

from queue_providers.text.errors import CorpusError

__all__ = ["CorpusError"]
