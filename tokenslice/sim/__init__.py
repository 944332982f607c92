"""The simulator: the same Engine and Scheduler on a virtual clock, with step times from a cost model
(docs/DESIGN.md, Simulator)."""
