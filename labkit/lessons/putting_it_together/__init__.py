"""Notebook 08: the controlled experiment over backends and graph modes (experiment), the
engine's steps on a timeline and their padding to graph buckets (engine_steps), the requests
both run (workload), and the transformers peer of the engine benchmark (transformers_peer)."""
