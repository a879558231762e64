"""labkit: the code behind the lab's notebooks. See README.md and notebooks/00_tour.ipynb."""
from labkit.device import configure_triton, fingerprint, select_device

# Must run before anything imports triton: with no GPU, Triton's kernels run in its interpreter.
configure_triton()


def _map_kernels_folder() -> None:
    """``labkit.kernels`` is the top-level ``kernels/`` folder (pyproject maps it). An editable
    install by an older setuptools ('setup.py develop') ignores that mapping: then load the
    folder from the checkout under its package name ourselves."""
    import importlib.util
    import sys
    from pathlib import Path

    if "labkit.kernels" in sys.modules or importlib.util.find_spec("labkit.kernels") is not None:
        return
    init = Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
    if init.exists():
        spec = importlib.util.spec_from_file_location(
            "labkit.kernels", init, submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["labkit.kernels"] = module
        spec.loader.exec_module(module)
        globals()["kernels"] = module


_map_kernels_folder()



def check_positive_int(name: str, value, hint: str = "") -> int:
    """``value`` as an int >= 1, or a ValueError naming ``name`` (bools are refused: True is not
    a count). ``hint`` says what the number counts, for the learner reading the error."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{f' ({hint})' if hint else ''}, "
                         f"got {value!r}")
    return value


def check_power_of_two(name: str, value, hint: str = "") -> int:
    """``value`` as an int that is 1, 2, 4, 8, ..., or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two{f' ({hint})' if hint else ''}, "
                         f"got {value!r}")
    return value


__all__ = ["check_positive_int", "check_power_of_two", "configure_triton", "fingerprint",
           "select_device"]
__version__ = "0.1.0"
