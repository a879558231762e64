"""What turns code into a lesson: the notebook's start, exercise checks with their hints, and
predictions revealed against the measurement."""
