"""Training a tokenizer on a corpus (BPE, WordPiece) and its command line."""
