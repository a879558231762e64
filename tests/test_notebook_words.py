"""A main notebook is read in one sitting: under about 1,600 words of markdown. Deep dives (a
SASS reading, a parameter sweep, a recorded history) go to an optional appendix notebook
(``06a_...``) beside it, which runs and is tested like the others."""
import json
import re

import pytest

from labkit.tools.run_notebooks import notebooks

MAIN_WORD_LIMIT = 1600


def markdown_words(path) -> int:
    cells = json.loads(path.read_text())["cells"]
    return sum(len(re.findall(r"\S+", "".join(c["source"])))
               for c in cells if c["cell_type"] == "markdown")


def test_the_count_is_of_markdown_words_only(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": ["Two words\n", "and three"]},
                    {"cell_type": "code", "source": ["x = 1  # not counted"]}]}
    (tmp_path / "nb.ipynb").write_text(json.dumps(nb))
    assert markdown_words(tmp_path / "nb.ipynb") == 4


def test_appendices_run_after_their_main_notebook():
    names = [p.stem for p in notebooks()]
    appendices = [n for n in names if re.match(r"\d\d[a-z]_", n)]
    for name in appendices:
        main = [n for n in names if n.startswith(name[:2] + "_")]
        assert main and names.index(main[0]) < names.index(name), (name, names)


@pytest.mark.parametrize("path", notebooks(appendices=False), ids=lambda p: p.stem)
def test_a_main_notebook_stays_under_the_word_limit(path):
    words = markdown_words(path)
    assert words <= MAIN_WORD_LIMIT, (
        f"{path.name}: {words} words of markdown, over {MAIN_WORD_LIMIT}: move a deep dive to an "
        f"appendix notebook ({path.stem[:2]}a_...) or say it in fewer words")


@pytest.mark.parametrize("path", [p for p in notebooks() if re.match(r"\d\d[a-z]_", p.stem)],
                         ids=lambda p: p.stem)
def test_the_main_notebook_links_its_appendix(path):
    main = next(p for p in notebooks(appendices=False) if p.stem[:2] == path.stem[:2])
    assert path.name in main.read_text(), f"{main.name} should link {path.name}"
