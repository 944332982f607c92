"""Predictors the scheduler and simulator consult: execution time (cost.py) and output length.

Nothing here imports torch: the simulator and the policies run on plain Python and numpy.
"""
