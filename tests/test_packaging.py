"""Set-up promises: conda and pip users get the same packages; kernels/ is labkit.kernels."""
import re
import sys
from pathlib import Path

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower()


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip_reqs = set(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        pip_reqs |= set(extra)
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda_pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert sorted(conda_pip) == sorted(pip_reqs), (
        "environment.yml and pyproject.toml disagree: "
        f"only in environment.yml {sorted(set(conda_pip) - pip_reqs)}, "
        f"only in pyproject {sorted(pip_reqs - set(conda_pip))}")


def test_kernels_folder_imports_as_labkit_kernels_not_top_level():
    import labkit.kernels

    assert Path(labkit.kernels.__file__).parent == ROOT / "kernels"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["package-dir"]["labkit.kernels"] == "kernels"
    assert "kernels" not in project["tool"]["setuptools"]["packages"]


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert [line for line in ci.splitlines() if line.startswith("make")] == ["make test"]
    first_commands = re.findall(r"^make (\w+)", readme, flags=re.M)[:2]
    assert first_commands == ["lab", "test"], f"README must open with make lab, make test: {first_commands}"


def test_cpu_setup_pins_the_cpu_torch_build():
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH_CPU ?= torch==2.13.0" in makefile, "an unpinned torch pulls a multi-GB CUDA build"
