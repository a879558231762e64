"""Notebook 03: the compile pipeline stage by stage (pipeline), graph breaks and their fixes
(graph_breaks), guards, recompiles, dynamic shapes against buckets, and the modes (recompiles)."""
