"""Notebook 08: the controlled experiment over backends and graph modes in shuffled rounds
(experiment), whether a row passed it (first_token), the peers as they declare themselves
(peers), the engine's steps on a timeline and their padding to graph buckets (engine_steps),
the requests all of them run (workload), what the notebook claims (claims), and the
transformers peer of the engine benchmark (transformers_peer)."""
