"""Measuring honestly: timing with warm-up and spread (bench), the machine's ceilings (peaks),
the profiler's events as a table (profile), drawn as a timeline (timeline)."""
