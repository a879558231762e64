"""Where a claim's figures come from, as its sentence says it."""
from __future__ import annotations


def on(recorded, device: str | None = None) -> str:
    """' on NVIDIA H200 (recorded)' for a recording, ' on <device>' for a live run."""
    if recorded is not None:
        return f" on {recorded.fingerprint['gpu']} (recorded)"
    return f" on {device}" if device else ""
