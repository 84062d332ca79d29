"""Structured outputs in the worker: each constrained row's grammar matcher, and the mask it
puts on the logits before sampling (the request side is router/structured_outputs.py)."""
