"""Exercises: every solution passes its check, every stub fails it with a message that helps,
common mistakes are named with their index, and student copies differ from the instructor's
only inside the solution markers.

Solutions come from where learners see them: the notebooks' marked cells and
``kernels/exercises/*.py``. Stubs come from a student copy written by ``labkit.tools.student``.
"""
import json
import re
from pathlib import Path

import pytest
import torch

from labkit.teaching import exercises
from labkit.tools import student
from labkit.teaching.check import check, compare_tensor
from labkit.device import interpreter_on
from labkit.teaching.exercises.bounds import bounds_checked

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = exercises.all_exercises()
IDS = sorted(EXERCISES)
TASK = re.compile(r"# BEGIN SOLUTION exercise (\d\d\.\d+):")
# What the untouched stub's failure must say (default: "Not written yet: exercise <id>").
STUB_SAYS = {"04.2": "Before refilling a buffer", "06.1": "still the stub",
             "06.2": "still the stub"}


def code_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def solution_cell(root: Path, exercise_id: str) -> str:
    """The notebook cell holding this exercise's marked solution (or stub)."""
    found = [src for nb in sorted((root / "notebooks").glob("*.ipynb")) for src in code_cells(nb)
             if any(m == exercise_id for m in TASK.findall(src))]
    assert len(found) == 1, f"exercise {exercise_id}: {len(found)} marked cells, expected one"
    return found[0]


def learner_function(root: Path, exercise_id: str):
    """(function, source) as a learner's copy under ``root`` defines them."""
    ex = EXERCISES[exercise_id]
    if ex.kernel_file:
        return None, root / "kernels" / "exercises" / ex.kernel_file
    namespace: dict = {"torch": torch}  # every notebook has torch imported
    exec(compile(solution_cell(root, exercise_id), f"<exercise {exercise_id}>", "exec"), namespace)
    return namespace[ex.entry], None


@pytest.fixture(scope="module")
def student_copy(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    student.write_copy(out)
    return out


def variant(tmp_path: Path, kernel_file: str, old: str, new: str) -> Path:
    """A copy of a solution file with one deliberate mistake."""
    text = (ROOT / "kernels" / "exercises" / kernel_file).read_text()
    assert old in text, f"{kernel_file} no longer contains {old!r}: update this test's mistake"
    path = tmp_path / kernel_file
    path.write_text(text.replace(old, new))
    return path


# --- solutions and stubs ---------------------------------------------------------------------
@pytest.mark.parametrize("exercise_id", IDS)
def test_every_solution_passes_its_check(exercise_id):
    fn, source = learner_function(ROOT, exercise_id)
    result = check(exercise_id, fn, source=source)
    assert result.passed, f"the instructor's solution fails its own check:\n{result!r}"
    assert len(result.cases) >= 4, "an exercise is checked on several inputs, awkward ones included"


@pytest.mark.parametrize("exercise_id", IDS)
def test_every_stub_fails_its_check_with_a_helpful_message(student_copy, exercise_id):
    fn, source = learner_function(student_copy, exercise_id)
    result = check(exercise_id, fn, source=source)
    assert not result.passed, f"the untouched stub of {exercise_id} passes its check"
    says = STUB_SAYS.get(exercise_id, f"Not written yet: exercise {exercise_id}")
    assert says in result.message, f"the stub's failure should say {says!r}:\n{result!r}"


def test_a_triton_exercise_is_checked_from_a_shell_too(student_copy, capsys):
    from labkit.teaching.check import main
    assert main(["06.2"]) == 0, "the instructor's solution passes"
    assert "still the stub" not in capsys.readouterr().out
    stub = student_copy / "kernels" / "exercises" / EXERCISES["06.2"].kernel_file
    assert main(["06.2", "--source", str(stub)]) == 1, "the untouched stub fails"
    assert "still the stub" in capsys.readouterr().out


def test_a_stub_that_raises_says_what_to_write(student_copy):
    result = check("05.2", learner_function(student_copy, "05.2")[0], device="cpu")
    assert EXERCISES["05.2"].task in result.message, result.message


# --- common mistakes, named where they happen --------------------------------------------------
interpreted = pytest.mark.skipif(not interpreter_on(), reason="out-of-bounds reports need "
                                 "Triton's interpreter (no GPU, or TRITON_INTERPRET=1)")


@interpreted
def test_an_off_by_one_key_mask_is_reported_with_program_id_and_offsets(tmp_path):
    path = variant(tmp_path, "attention_tile_loop.py", "in_seq = keys < len_k",
                   "in_seq = keys <= len_k")
    result = check("06.1", source=path, device="cpu")
    assert not result.passed
    assert "out-of-bounds load: program id (0, 0, 0)" in result.message, result.message
    assert re.search(r"K\[37, 0, 0\]", result.message), "the first key row past the end is named"


@interpreted
def test_a_causal_mask_that_hides_the_diagonal_names_the_wrong_element(tmp_path):
    path = variant(tmp_path, "attention_tile_loop.py", "(keys[None, :] <= pos[:, None])",
                   "(keys[None, :] < pos[:, None])")
    result = check("06.1", source=path, device="cpu")
    assert not result.passed
    assert re.search(r"out\[\d+, \d+, \d+\] is .*expected", result.message), result.message
    assert "hides the diagonal" in result.message


@interpreted
def test_a_merge_without_the_split_mask_reads_past_the_lse_tensor(tmp_path):
    path = variant(tmp_path, "split_kv_merge.py", 'tl.load(lse_ptrs, mask=real, other=float("-inf"))',
                   "tl.load(lse_ptrs)")
    result = check("06.2", source=path, device="cpu")
    assert not result.passed
    assert "out-of-bounds load: program id" in result.message and "Lse" in result.message


@interpreted
def test_an_unweighted_merge_is_named(tmp_path):
    path = variant(tmp_path, "split_kv_merge.py",
                   'weight = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))',
                   'weight = tl.where(real & (lse > float("-inf")), 1.0, 0.0)')
    result = check("06.2", source=path, device="cpu")
    assert "averaged the splits' partials equally" in result.message, result.message


def test_rebinding_the_static_input_is_named():
    def run_captured(chain, x):
        chain.static_input = x
        chain.replay()
        return chain.static_output.clone()

    result = check("01.1", run_captured, device="cpu")
    assert "first result[0] is" in result.message and "copy_" in result.message, result.message


def test_keeping_the_graphs_output_buffer_is_named():
    def run_captured(chain, x):
        chain.static_input.copy_(x)
        chain.replay()
        return chain.static_output

    result = check("01.1", run_captured, device="cpu")
    assert "Return a clone" in result.message, result.message


def test_returning_the_padding_rows_is_named():
    def run_bucketed(pool, x):
        bucket = next((b for b in pool.buckets if b >= len(x)), None)
        if bucket is None:
            return pool.fn(x)
        pool.static_input[:len(x)].copy_(x)
        pool.graphs[bucket].replay()
        return pool.graphs[bucket].outputs.clone()

    result = check("02.2", run_bucketed, device="cpu")
    assert "rows for a batch of 3" in result.message, result.message


def test_right_numbers_with_a_graph_break_still_fail():
    def clip_norm(x, max_norm):
        norm = x.norm()  # a tensor's truth value in an `if`: data-dependent control flow
        return x * (max_norm / norm) if norm > max_norm else x

    result = check("03.1", clip_norm, device="cpu")
    assert not result.passed and all(c.passed for c in result.cases), result.message
    assert "breaks the graph" in result.message, result.message


def test_a_norm_taken_out_of_autograd_with_item_fails_on_the_gradient():
    def clip_norm(x, max_norm):
        norm = x.norm().item()  # a Python float: the clip no longer depends on x for autograd
        return x * (max_norm / norm) if norm > max_norm else x

    result = check("03.1", clip_norm, device="cpu")
    assert not result.passed and "grad" in result.message, result.message


def test_waiting_for_the_whole_copy_stream_is_right_but_too_much():
    def send_batch(ring, batch):
        i = ring.next_index()
        ring.copy_stream.synchronize()
        ring.buffers[i][: len(batch)].copy_(batch)
        dst, ring.last_copy[i] = ring.copy_async(i, len(batch))
        return dst

    result = check("04.2", send_batch, device="cpu")
    assert not result.passed and "never more than 1 copy was in flight" in result.message


def test_a_lookup_that_serves_the_whole_prompt_is_named():
    from labkit.teaching.exercises.paged_kv_cache import ROOT as root_hash, chain_hash

    def cached_prefix_len(registered, token_ids, block_size):
        parent, hits = root_hash, 0
        for i in range(len(token_ids) // block_size):
            parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
            if parent not in registered:
                break
            hits += 1
        return hits * block_size

    result = check("05.2", cached_prefix_len, device="cpu")
    assert "one token must stay" in result.message and "cached tokens is" in result.message


def test_a_learners_exception_is_shown_at_the_learners_line():
    def slot_mapping(block_table, start, end, block_size):
        return [block_table[p // block_size] * block_size + p % block_sise
                for p in range(start, end)]

    result = check("05.1", slot_mapping, device="cpu")
    assert "NameError" in result.message and "block_sise" in result.message, result.message


# --- the checker itself --------------------------------------------------------------------------
def test_each_check_draws_fresh_inputs_and_a_seed_replays_them():
    def slot_mapping(block_table, start, end, block_size):
        return []

    runs = [check("05.1", slot_mapping, device="cpu") for _ in range(2)]
    assert runs[0].seed != runs[1].seed
    again = check("05.1", slot_mapping, seed=runs[0].seed, device="cpu")
    assert again.message == runs[0].message and again.seed == runs[0].seed


def test_compare_names_the_first_and_the_worst_wrong_index():
    expected = torch.zeros(3, 4)
    got = expected.clone()
    got[1, 2], got[2, 0] = 0.5, 3.0
    msg = compare_tensor("out", got, expected, atol=1e-6, rtol=0)
    assert msg.startswith("out[1, 2] is 0.5, expected 0") and "2 of 12" in msg
    assert "the worst is out[2, 0]" in msg
    assert "shape (3, 5) but should have (3, 4)" in compare_tensor(
        "out", torch.zeros(3, 5), expected, 1e-6, 0)


def test_the_result_shows_as_a_box_in_jupyter_and_as_text():
    fn, _ = learner_function(ROOT, "05.1")
    result = check("05.1", fn, device="cpu")
    assert "05.1" in result._repr_html_() and "&#10003;" in result._repr_html_()
    assert repr(result).startswith("PASSED")


@interpreted
def test_the_bounds_check_leaves_the_interpreter_as_it_found_it():
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    before = interpreter.GridExecutor._init_args_hst
    with bounds_checked():
        pass
    assert "create_masked_load" not in vars(builder) and "create_masked_store" not in vars(builder)
    assert interpreter.GridExecutor._init_args_hst is before


def test_an_unknown_exercise_lists_the_known_ones():
    with pytest.raises(KeyError, match="01.1"):
        check("99.9", lambda: None)


# --- student and instructor copies ---------------------------------------------------------------
def outside_markers(text: str) -> list[str]:
    lines = text.split("\n")
    keep, inside = [], False
    for line in lines:
        if student.BEGIN.match(line):
            inside = True
            keep.append(line)
        elif student.END.match(line):
            inside = False
            keep.append(line)
        elif not inside:
            keep.append(line)
    return keep


def copy_texts(root: Path) -> dict[str, list[str]]:
    texts = {}
    for path in student.sources(root):
        rel = str(path.relative_to(root))
        texts[rel] = code_cells(path) if path.suffix == ".ipynb" else [path.read_text()]
    return texts


def test_student_copies_differ_from_instructor_copies_only_inside_markers(student_copy, tmp_path):
    student.write_copy(tmp_path, instructor=True)
    for rel, instructor in copy_texts(tmp_path).items():
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), \
            f"the instructor copy of {rel} must be the source itself"
        stub = copy_texts(student_copy)[rel]
        assert len(stub) == len(instructor), f"{rel}: the student copy has other cells"
        for a, b in zip(instructor, stub):
            assert outside_markers(a) == outside_markers(b), f"{rel} differs outside the markers"
    changed = {rel for rel, t in copy_texts(student_copy).items() if t != copy_texts(ROOT)[rel]}
    marked = {rel for rel, texts in copy_texts(ROOT).items()
              if any(student.regions(t.split("\n")) for t in texts)}
    assert changed == marked and len(marked) >= 7, \
        f"files with solutions {sorted(marked)}, files changed in the student copy {sorted(changed)}"


def test_markers_are_balanced_and_name_a_known_exercise_everywhere():
    named = []
    for path in student.sources(ROOT):
        texts = code_cells(path) if path.suffix == ".ipynb" else [path.read_text()]
        for text in texts:
            for region in student.regions(text.split("\n"), path.name):
                match = re.match(r"exercise (\d\d\.\d+):", region.task)
                assert match and match[1] in EXERCISES, f"{path.name}: {region.task!r}"
                named.append(match[1])
    notebook_ids = {e for e in IDS if not EXERCISES[e].kernel_file}
    assert sorted(named) == sorted(notebook_ids | {e for e in IDS if EXERCISES[e].kernel_file}), \
        "every exercise has exactly one marked solution"


def test_unbalanced_markers_are_refused_with_their_line():
    with pytest.raises(student.MarkerError, match=":2: BEGIN SOLUTION is never closed"):
        student.regions(["x = 1", "    # BEGIN SOLUTION exercise 01.1: y", "    y = 2"], "f.py")
    with pytest.raises(student.MarkerError, match=":1: END SOLUTION with no BEGIN"):
        student.regions(["# END SOLUTION"], "f.py")


def test_a_stub_keeps_the_indentation_and_raises_with_the_task():
    text = ("def f():\n    # BEGIN SOLUTION exercise 05.1: the slots\n    return 1\n"
            "    # END SOLUTION\n")
    stub = student.student_text(text)
    assert '    raise NotImplementedError("exercise 05.1: the slots")' in stub
    namespace: dict = {}
    exec(stub, namespace)
    with pytest.raises(NotImplementedError, match="exercise 05.1: the slots"):
        namespace["f"]()


def test_the_command_line_writes_both_copies(tmp_path, capsys):
    assert student.main(["--out", str(tmp_path / "s")]) == 0
    assert student.main(["--out", str(tmp_path / "i"), "--instructor"]) == 0
    nb = "notebooks/05_paged_kv_cache.ipynb"
    assert (tmp_path / "i" / nb).read_bytes() == (ROOT / nb).read_bytes()
    assert "raise NotImplementedError" in (tmp_path / "s" / nb).read_text()
    assert "student (solutions -> stubs) copy" in capsys.readouterr().out


# --- on a GPU: the same checks with real graphs, streams and compiled kernels ----------------------
@pytest.mark.gpu
@pytest.mark.parametrize("exercise_id", IDS)
def test_every_solution_passes_on_the_gpu(exercise_id):
    fn, source = learner_function(ROOT, exercise_id)
    result = check(exercise_id, fn, source=source, device="cuda")
    assert result.passed, repr(result)


@pytest.mark.gpu
def test_on_the_gpu_refilling_a_pinned_buffer_at_once_corrupts_batches():
    from labkit.teaching.exercises import pinned_memory

    run = pinned_memory.send_all(pinned_memory.refill_at_once, 1, [1 << 16] * 8, "cuda")
    assert run["arrived"] != list(range(8)), "the copy stream was busy: early refills must show"
