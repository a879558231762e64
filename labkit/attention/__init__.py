"""Attention kernels, references and backend selection (issue 4)."""
