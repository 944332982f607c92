"""Benchmarking: workloads (datasets.py, lengths.py, arrivals.py, priority_patterns.py,
workloads.py), the HTTP load client (client*.py, request_stream.py, server_counters.py), latency
statistics and the results file (metrics.py, report.py), `tokenslice bench` sweeps (sweep.py), and
the output-length predictor's datasets and evaluation (lengthdata.py, length_eval.py).

Shared by the simulator, the HTTP benchmark client and `tokenslice predictor`; nothing here
imports torch unless a length predictor (torch and faiss) is asked for.
"""
