"""Curriculum selection: candidates scored by token neglect against an alpha-blended target.

schedule.py  which alpha applies to each served batch (config schedule, SetCurriculum overrides)
corpus.py    the corpus token distribution, estimated once and cached in the dataset dir
composer.py  the buffer of candidate batches and the pick, cull and retire rules (numpy)
candidate_files.py  a candidate file with its token histograms; a served file copied out of them
changes.py   SetCurriculum: alpha from a seq every rank agrees on, journaled first
lane.py      the composer as the producer of a curriculum split, as the split queue sees it
"""
