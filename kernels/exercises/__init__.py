"""Triton exercises: open a file, write the part between the SOLUTION markers, then run
``labkit.check.check("<id>")`` (notebook 06 does). Each file says what to write and why.

The checker reads the file afresh at every check, from ``kernels/exercises/`` next to your
notebooks' folder: edit the file, save it, rerun the check.
"""
