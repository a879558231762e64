from pathlib import Path

from labkit.attention.matrix import sync_readme

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_compatibility_matrix_is_the_generated_one():
    assert sync_readme(README), ("README.md's compatibility matrix differs from the backends' "
                                 "declarations: run `python -m labkit.attention.matrix README.md`")
