"""Which device the lab runs on, whether Triton runs compiled or interpreted, and a fingerprint.

Triton reads ``TRITON_INTERPRET`` once, when it is imported, so the choice has to be made before
anything imports ``triton``: ``import labkit`` calls :func:`configure_triton` for that reason.
"""
from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
import warnings

import torch

DEVICE_CHOICES = ("auto", "cuda", "cpu")


def cuda_available() -> bool:
    return torch.cuda.is_available()


def configure_triton() -> bool:
    """Turn on Triton's interpreter where there is no CUDA device. Returns whether it is on."""
    if not cuda_available() and "TRITON_INTERPRET" not in os.environ:
        if "triton" in sys.modules:
            warnings.warn(
                "triton was imported before labkit on a machine with no GPU, so its interpreter "
                "could not be switched on: import labkit first, or set TRITON_INTERPRET=1",
                stacklevel=2,
            )
        else:
            os.environ["TRITON_INTERPRET"] = "1"
    if interpreter_on():
        _check_numpy_for_interpreter()
    return interpreter_on()


def _check_numpy_for_interpreter() -> None:
    import numpy

    major, minor = (int(p) for p in numpy.__version__.split(".")[:2])
    if (major, minor) >= (2, 4):
        warnings.warn(
            f"NumPy {numpy.__version__} breaks Triton 3.6's interpreter on loops with a runtime "
            "bound ('only 0-dimensional arrays can be converted'); install 'numpy<2.4' where "
            "kernels run interpreted (make lab and make test do)", stacklevel=3)


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` picks the GPU when there is one; ``"cuda"`` insists on it; ``"cpu"`` forces CPU."""
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if cuda_available() else "cpu")
    if name.startswith("cuda"):
        if not cuda_available():
            raise RuntimeError(
                f"device={name!r} was asked for, but this machine has no CUDA device that torch "
                f"can use (torch {torch.__version__}, built with CUDA {torch.version.cuda}). "
                'Use DEVICE="auto" (or "cpu") to run here with CPU analogues and the recorded '
                "GPU figures, or run on a GPU host."
            )
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device must be one of {DEVICE_CHOICES} (or 'cuda:N'), got {device!r}")


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def fingerprint() -> dict:
    """What this machine is: enough to say where a number came from."""
    on_gpu = cuda_available()
    props = torch.cuda.get_device_properties(0) if on_gpu else None
    return {
        "gpu": props.name if props else None,
        "compute_capability": f"{props.major}.{props.minor}" if props else None,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1) if props else None,
        "sm_count": props.multi_processor_count if props else None,
        "driver": _driver_version() if on_gpu else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "interpreter": interpreter_on(),
    }


def describe(fp: dict | None = None) -> str:
    """One line a learner can read: ``NVIDIA H200 (driver 580.1, CUDA 13.0) | torch 2.11 ...``."""
    fp = fp or fingerprint()
    where = (
        f"{fp['gpu']} (sm {fp.get('compute_capability')}, driver {fp.get('driver')}, CUDA {fp.get('cuda')})"
        if fp.get("gpu")
        else f"CPU only ({fp.get('cpu_count')} cores)"
    )
    triton = f"triton {fp['triton']}" + (" [interpreter]" if fp.get("interpreter") else "")
    return f"{where} | torch {fp['torch']} | {triton} | python {fp['python']}"


def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU, whose ops finish as they return)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: str | torch.device) -> None:
    """Drop unreferenced tensors now and hand cached device memory back, between experiments."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
