"""Benchmarking: workload generation (workloads.py) and latency statistics (metrics.py).

Shared by the simulator and the HTTP benchmark client; nothing here imports torch.
"""
