"""Notebook 08: the controlled experiment over backends and graph modes in shuffled rounds
(experiment), whether a row passed it (first_token), the peers as they declare themselves
(peers), the engine's steps on a timeline (engine_steps), the requests all of them run
(workload), what the notebook claims (claims), and the transformers peer of the engine
benchmark (transformers_peer). Its appendix 08a: the steps' padding to graph buckets, counted
and priced (padding), and what it claims about them (padding_claims)."""
