"""Notebook 02: capture and replay, what a graph freezes (pitfalls), a decode-like stack of
small kernels (decode_stack), what replaying it from a GraphPool gains and costs, timed in
interleaved rounds (measurements), the figures (figures) and the sentences the notebook claims
from those numbers (claims)."""
