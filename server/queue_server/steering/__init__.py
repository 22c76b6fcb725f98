"""Steering a split mid-run (SetMixture, SetCurriculum): what a change needs from the split it
changes (port.py), so the changes modules never reach into SplitQueue's internals."""
