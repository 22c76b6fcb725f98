"""token_shards: pre-tokenized corpora (raw .bin, llm.c, .npy, Megatron, prepared), each
window once per epoch. One module per format reader, the corpus index, the epoch order and
the provider."""

from queue_providers.token_shards.provider import TokenShardsProvider

__all__ = ["TokenShardsProvider"]
