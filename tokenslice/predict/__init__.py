"""Predictors the scheduler and simulator consult: execution time (cost.py) and output length.

cost.py imports no torch: the simulator and the policies run on plain Python and numpy. The
output-length predictor (length.py and its helpers: sentence embeddings, an MLP) does, and is
imported only where a predictor is used.
"""
