"""KV-cache bookkeeping: which blocks each request owns, on which tier. No tensors here."""
