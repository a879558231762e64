"""labkit: the code behind the lab's notebooks. See README.md and notebooks/00_tour.ipynb."""
from labkit.device import configure_triton, fingerprint, select_device

# Must run before anything imports triton: with no GPU, Triton's kernels run in its interpreter.
configure_triton()

__all__ = ["configure_triton", "fingerprint", "select_device"]
__version__ = "0.1.0"
