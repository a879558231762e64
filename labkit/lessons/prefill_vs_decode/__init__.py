"""Notebook 07 and its appendix 07a: what a prefill and a decode step cost from their shapes
(cost), the real forward timed eagerly and replayed (forward), what bounds each measured step
(bounds) and their figures; TTFT and TPOT from the engine (latency); a long prompt's stall with
and without chunked prefill (chunked_prefill); the claims made from all of them (claims)."""
