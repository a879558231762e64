"""Notebook 07: where a prefill and a decode forward sit on the roofline and what graphs do for
each (forward); TTFT, TPOT and a long prompt's stall with and without chunked prefill
(chunked_prefill)."""
