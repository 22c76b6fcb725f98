"""One split's queue: its owner (SplitQueue), the schedule of which seq each rank reads, the leases, and the split's state, stats and rates."""
