"""Benchmarking: workload generation (workloads.py), latency statistics (metrics.py), and the
output-length predictor's datasets and evaluation (lengthdata.py, length_eval.py).

Shared by the simulator, the HTTP benchmark client and `tokenslice predictor`; nothing here
imports torch unless a length predictor (torch and faiss) is asked for.
"""
