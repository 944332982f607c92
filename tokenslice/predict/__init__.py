"""Predictors the scheduler and simulator consult: execution time (cost.py: the CostModel
interface; roofline.py, profile.py, fit.py, specs.py) and output length.

The cost models import no torch: the simulator and the policies run on plain Python and numpy. The
output-length predictor (length.py and its helpers: sentence embeddings, an MLP) does, and is
imported only where a predictor is used.
"""
