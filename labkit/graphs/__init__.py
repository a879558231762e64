"""CUDA Graphs as engines use them: a pool of graphs captured per batch-size bucket (static
buffers, padding, stats), the lookup of a size's bucket, and a planner that chooses the buckets
for a workload."""
from labkit.graphs.buckets import bucket_for
from labkit.graphs.pool import DEFAULT_BUCKETS, BucketStats, GraphPool, PoolStats, capture_graph

__all__ = ["DEFAULT_BUCKETS", "BucketStats", "GraphPool", "PoolStats", "bucket_for",
           "capture_graph"]
