from pathlib import Path

from labkit.attention.matrix import sync_readme

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_compatibility_matrix_is_the_generated_one():
    assert sync_readme(README), ("README.md's compatibility matrix differs from the backends' "
                                 "declarations: run `python -m labkit.attention.matrix README.md`")


def test_the_readme_layout_has_one_line_per_package():
    text = README.read_text()
    layout = text[text.index("## Layout"):text.index("## Recorded GPU figures")]
    packages = sorted(p.parent.name for p in (README.parent / "labkit").glob("*/__init__.py"))
    missing = [p for p in packages if f"\n  {p}/ " not in layout]
    assert not missing, f"README's Layout section lacks {missing}"
