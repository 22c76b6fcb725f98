"""A split's journal: typed records and replay, appends kept through disk errors, compaction, and the split's directory reconciled with it at start."""
