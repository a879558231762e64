"""Attention kernels, references and backend selection.

``flash_attention``, ``paged_attention`` and ``paged_mla_attention`` are labkit's Triton
kernels (``kernels/``); ``*_ref`` are their float64 definitions; ``select_backend`` picks among
``BACKENDS`` and says why.
"""
import labkit  # noqa: F401  (interpreter on before triton is imported, where there is no GPU)
from labkit.attention.backends import BACKENDS, PRIORITY, Backend
from labkit.attention.matrix import compatibility_matrix, matrix_markdown
from labkit.attention.reference import (flash_attention_ref, paged_attention_ref,
                                        paged_mla_attention_ref)
from labkit.attention.selection import (CPU_SLOW, AttentionSpec, BackendUnavailable,
                                        example_specs, explain, reasons_against, select_backend,
                                        selection_lines)
from labkit.kernels.flash_attention import flash_attention
from labkit.kernels.paged_attention import paged_attention
from labkit.kernels.paged_mla_attention import paged_mla_attention

__all__ = [
    "BACKENDS", "CPU_SLOW", "PRIORITY", "AttentionSpec", "Backend", "BackendUnavailable",
    "compatibility_matrix", "example_specs", "explain",
    "flash_attention", "flash_attention_ref", "matrix_markdown", "paged_attention",
    "paged_attention_ref", "paged_mla_attention", "paged_mla_attention_ref", "reasons_against",
    "select_backend", "selection_lines",
]
