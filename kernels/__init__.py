"""Triton kernels, one concept per file. Imported as ``labkit.kernels`` (see pyproject.toml).

Import ``labkit`` before these so that, with no GPU, Triton's interpreter is on.
"""
import labkit  # noqa: F401  (switches the interpreter on where there is no GPU)
