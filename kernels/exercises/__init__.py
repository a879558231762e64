"""Triton exercises: open a file, write the part between the SOLUTION markers, then run
``labkit.teaching.check.check("<id>")`` (notebook 06 does) or ``python -m labkit.teaching.check
<id>`` in a shell. Each file says what to write and why.

The checker reads the file afresh at every check, from ``kernels/exercises/`` next to your
notebooks' folder: edit the file, save it, rerun the check.
"""
