"""Paged KV cache: block manager with prefix caching, and the KV tensors (issue 3)."""
