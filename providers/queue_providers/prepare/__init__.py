"""Prepare a text corpus once for pretraining: tokenize it into shards of token ids plus a
manifest.json, resumable after a kill, identical for any number of worker processes.

cli.py is the command line (`queue-prepare`), run.py one run; corpus.py says what is read,
tokenizer.py with what, encode.py tokenizes in worker processes, sharder.py cuts the token
stream into shards, layout.py owns the files and state.py the resume record; verify.py
checks a finished corpus against its manifest. The format is described in
docs/providers/prepare.md.
"""

from queue_providers.prepare.cli import main
from queue_providers.prepare.corpus import CorpusSpec
from queue_providers.prepare.run import PrepareOptions, PrepareResult, prepare
from queue_providers.prepare.verify import Verified, verify

__all__ = ["CorpusSpec", "PrepareOptions", "PrepareResult", "Verified", "main", "prepare", "verify"]
