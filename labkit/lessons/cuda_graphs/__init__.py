"""Notebook 02: capture and replay, what a graph freezes (pitfalls), a decode-like stack of
small kernels (decode_stack) and what replaying it from a GraphPool gains and costs (measurements)."""
