"""Notebook 06 and its appendix 06a: every backend on one workload, checked and timed (compare),
the roofline they sit on and the targets (roofline), their figures (figures), the fp8 decode loop
compiled for sm_90 and counted (sass), the fp8 cache's accuracy (fp8_accuracy), and what the
notebooks claim from those measurements, one file per concept (claims_io, claims_selection,
claims_speed, claims_fp8, claims_registry)."""
