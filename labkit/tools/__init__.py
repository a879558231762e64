"""The lab's tooling: the lab server, headless notebook runs, the GPU check, recordings of GPU
figures, HTML handouts and student copies. Each is a ``python -m labkit.tools.<name>`` command
that the Makefile names; none of them is imported by the mechanisms or the lessons' code paths
except :mod:`labkit.tools.recorded`, which loads the figures recorded on a GPU."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
