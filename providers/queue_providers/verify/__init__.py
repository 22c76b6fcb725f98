"""Checking a provider's output: diversity of its batches and near-duplicates among them."""
