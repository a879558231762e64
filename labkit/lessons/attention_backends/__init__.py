"""Notebook 06: every backend on one workload, checked and timed (compare), the roofline they
sit on and the targets (roofline), the fp8 decode loop compiled for sm_90 and counted (sass),
and what the notebook claims from those measurements (claims)."""
