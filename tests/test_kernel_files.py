"""Every kernel file reads as Triton's tutorials do and runs as a script: its __main__ checks the
kernel against its reference (and times it) on this machine, under the interpreter without a GPU."""
import subprocess
import sys
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
FILES = sorted(p for p in KERNELS.glob("*.py") if p.name not in ("__init__.py", "attention_checks.py"))


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_kernel_file_checks_itself_as_a_script(path):
    text = path.read_text()
    assert 'if __name__ == "__main__":' in text, f"{path.name} has no check under __main__"
    if "import triton" in text:  # a plan-only file may not import it at all
        assert text.index("import labkit") < text.index("import triton"), \
            f"{path.name} must import labkit before triton (the interpreter is chosen at import)"
    run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"python {path.name} failed:\n{run.stderr[-2000:]}"
    assert run.stdout.strip(), f"python {path.name} printed nothing"
