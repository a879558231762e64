"""The rule of measured truth, checked on every notebook's source.

A measured number belongs in a claim (``labkit.teaching.claim``), rendered from the run that
measured it; static markdown explains and carries none. So a markdown line may not state a
figure with a unit of time, rate, ratio or share, unless it says it is a datasheet figure. And
every notebook ends by asserting that its claims held, with enough of them to mean something.
"""
import io
import json
import re
import tokenize

import pytest

from labkit.tools.run_notebooks import notebooks

NOTEBOOKS = notebooks()
MIN_CLAIMS = 5

# a figure followed by a unit that only a measurement (or a target) has: 12 us, 3.4 ms, 1.4x,
# 71%, 4.27 TB/s, 460 TFLOP/s ... Sizes (MiB, elements, tokens) are parameters and pass.
MEASURED = re.compile(
    r"(?<![\w.^/])[~≈]?\d[\d,]*(?:\.\d+)?"
    r"(?:\s?(?:us|µs|μs|ms|ns|s|%|[TGM]B/s|[TG]FLOP/s|FLOP/B|tok/s|tokens/s)|x|×)(?![\w/])")
ALLOWED = re.compile(r"datasheet", re.IGNORECASE)


def typed_figures(markdown: str) -> list[str]:
    """The lines of ``markdown`` that state a measured-looking figure without a datasheet."""
    return [line.strip() for line in markdown.splitlines()
            if MEASURED.search(line) and not ALLOWED.search(line)]


def test_the_lint_sees_a_typed_figure_and_lets_explanations_pass():
    assert typed_figures("Replay takes about 9.3 us per kernel.")
    assert typed_figures("the graph is 10.3x faster")
    assert typed_figures("decode reads at 71% of the copy ceiling")
    assert typed_figures("the copy ran at 4.27 TB/s")
    assert not typed_figures("The H200 datasheet gives 4.8 TB/s of HBM bandwidth.")
    assert not typed_figures("A chain of 100 kernels over 4,096 elements (a 1 MiB buffer).")
    assert not typed_figures("`x.add_(1)` n times; 2**k elements; sm 8.9; B4 H32 S4096 D128")
    assert not typed_figures("four waves of programs: 4 x 132 / 8 splits")


def _cells(path):
    return json.loads(path.read_text())["cells"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_markdown_cell_states_a_measured_figure(path):
    typed = {i: typed_figures("".join(c["source"])) for i, c in enumerate(_cells(path))
             if c["cell_type"] == "markdown"}
    typed = {i: lines for i, lines in typed.items() if lines}
    assert not typed, (f"{path.name}: markdown states measured figures (make them claims, "
                       f"computed from this run): {typed}")


def typed_comments(source: str) -> list[str]:
    """The comments of a code cell that state a measured-looking figure (a learner reads them
    as the notebook's word, like markdown)."""
    code = "\n".join(line for line in source.splitlines()
                     if not line.lstrip().startswith(("%", "!")))  # IPython magics
    return [t.string for t in tokenize.generate_tokens(io.StringIO(code).readline)
            if t.type == tokenize.COMMENT and typed_figures(t.string)]


def test_the_comment_lint_reads_comments_not_code():
    assert typed_comments("x = 1  # replay is ~3x faster\n")
    assert not typed_comments("assert gain > 2, 'should be over 2x faster'  # the target\n")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_code_comment_states_a_measured_figure(path):
    typed = {i: typed_comments("".join(c["source"])) for i, c in enumerate(_cells(path))
             if c["cell_type"] == "code"}
    typed = {i: lines for i, lines in typed.items() if lines}
    assert not typed, f"{path.name}: code comments state measured figures: {typed}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_last_cell_asserts_that_every_claim_held(path):
    code = [c for c in _cells(path) if c["cell_type"] == "code"]
    last = "".join(code[-1]["source"])
    found = re.search(r"assert_claims_held\(\s*minimum\s*=\s*(\d+)\s*\)", last)
    assert found, f"{path.name}: the last code cell must call assert_claims_held(minimum=N)"
    assert int(found.group(1)) >= MIN_CLAIMS, (
        f"{path.name}: asserts only {found.group(1)} claims; at least {MIN_CLAIMS}")
