"""Data mixtures on the server: the [datasets.NAME.sources.*] config, SetMixture, stats
(docs/mixtures.md). The files are composed in the workers by queue_providers.mixture."""
