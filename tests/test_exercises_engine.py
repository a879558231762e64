"""Exercises of notebooks 07 and 08: common mistakes are named, not just failed.

Each test hands ``labkit.teaching.check`` a solution with one typical mistake and asserts that the
message names it. The exercises' own solution/stub checks are in test_exercises.py.
"""
import torch

from labkit.teaching.check import check


def _decode_step_cost(config, batch, context, dtype_bytes):
    c = config
    per_layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    flops = (2 * batch * (c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size)
             + 4 * c.num_attention_heads * c.head_dim * c.num_hidden_layers * batch * context)
    return {"flops": flops,
            "weight_bytes": dtype_bytes * (c.num_parameters() - c.vocab_size * c.hidden_size),
            "kv_bytes": dtype_bytes * c.num_hidden_layers * 2 * c.kv_size * batch * (context + 1)}


def test_weights_counted_once_per_row_are_named():
    def decode_step_cost(config, batch, context, dtype_bytes):
        cost = _decode_step_cost(config, batch, context, dtype_bytes)
        return {**cost, "weight_bytes": batch * cost["weight_bytes"]}

    result = check("07.1", decode_step_cost, device="cpu")
    assert "weight_bytes is" in result.message and "read once per step" in result.message, \
        result.message


def test_a_kv_count_without_the_new_tokens_write_is_named():
    def decode_step_cost(config, batch, context, dtype_bytes):
        cost = _decode_step_cost(config, batch, context, dtype_bytes)
        return {**cost, "kv_bytes": cost["kv_bytes"] * context // (context + 1)}

    result = check("07.1", decode_step_cost, device="cpu")
    assert "context 1" in result.message and "writes one" in result.message, result.message


def _plan(decoding, prefilling, waiting, budget, max_num_seqs, *, chunk=True):
    """Exercise 07.2's rule; ``chunk=False`` is the mistake of never cutting a prompt."""
    rows, running = [(r, 1) for r in decoding], len(decoding) + len(prefilling)
    budget -= len(rows)
    for r, n, is_new in [(r, n, False) for r, n in prefilling] + [(r, n, True) for r, n in waiting]:
        if budget == 0 or (is_new and running >= max_num_seqs) or (not chunk and n > budget):
            break
        rows.append((r, min(n, budget)))
        budget, running = budget - rows[-1][1], running + is_new
    return rows


def test_the_plan_step_helper_of_these_tests_is_right():
    assert check("07.2", _plan, device="cpu").passed, "fix _plan before trusting the tests below"


def test_a_plan_that_admits_past_max_num_seqs_is_named():
    result = check("07.2", lambda d, p, w, budget, seqs: _plan(d, p, w, budget, 10**6),
                   device="cpu")
    assert "max_num_seqs is" in result.message and "admit a waiting prompt only while" \
        in result.message, result.message


def test_a_plan_that_never_cuts_a_prompt_is_named():
    result = check("07.2", lambda *args: _plan(*args, chunk=False), device="cpu")
    assert "of the budget unused" in result.message and "chunk" in result.message, result.message


def _overlap(events, *, lane_by="time", keep_compute_lane=False):
    kernels = events[events.kind == "kernel"]
    if kernels.empty:
        return {}
    lane = (kernels.groupby("lane").dur_us.sum().idxmax() if lane_by == "time"
            else kernels.lane.value_counts().idxmax())
    busy = kernels[kernels.lane == lane]
    copies = events[(events.kind == "memcpy") & events.name.str.contains("HtoD")
                    & ((events.lane != lane) | keep_compute_lane)]
    return {i: float((busy.start_us + busy.dur_us).clip(upper=s + d).sub(
        busy.start_us.clip(lower=s)).clip(lower=0).sum())
        for i, s, d in zip(copies.index, copies.start_us, copies.dur_us)}


def test_the_overlap_helper_of_these_tests_is_right():
    assert check("08.1", _overlap, device="cpu").passed, "fix _overlap before the tests below"


def test_a_copy_on_the_compute_stream_counted_as_overlap_is_named():
    result = check("08.1", lambda ev: _overlap(ev, keep_compute_lane=True), device="cpu")
    assert "runs on the compute lane itself" in result.message, result.message
    assert "overlap per copy has" in result.message, "the wrong output is named first"


def test_a_compute_lane_chosen_by_kernel_count_is_named():
    result = check("08.1", lambda ev: _overlap(ev, lane_by="count"), device="cpu")
    assert "Count time, not kernels" in result.message, result.message
    assert "a lane with more kernels" in result.message, "the input that shows it is named"


def test_padding_with_unsorted_buckets_is_named():
    def padded_rows(batches, buckets):
        fits = [next((b for b in buckets if b >= x), None) for x in batches]
        return (sum(b - x for b, x in zip(fits, batches) if b is not None),
                fits.count(None))

    result = check("08.2", padded_rows, device="cpu")
    assert "padded rows is" in result.message and "Sort them" in result.message, result.message


def test_batches_beyond_the_largest_bucket_left_uncounted_are_named():
    def padded_rows(batches, buckets):
        buckets = sorted(set(buckets))
        return sum(next((b for b in buckets if b >= x), x) - x for x in batches), 0

    result = check("08.2", padded_rows, device="cpu")
    assert "eager steps is 0" in result.message and "run eagerly" in result.message, \
        result.message


def test_the_batching_measurement_leaves_the_thread_count_as_it_found_it():
    from labkit.engine import ModelConfig, random_model
    from labkit.teaching.exercises.putting_it_together import output_tok_s
    from labkit.lessons.putting_it_together.experiment import Workload

    threads = torch.get_num_threads()
    rate = output_tok_s(random_model(ModelConfig.tiny(), seed=0), Workload(3, (4, 8), (2, 4)), 3,
                        runs=2)
    assert rate > 0 and torch.get_num_threads() == threads
