"""A dataset made of several sources, each a provider of its own (docs/mixtures.md)."""

from queue_providers.mixture.provider import MixtureProvider

__all__ = ["MixtureProvider"]
