"""The engine's MLA prefill path: rows of a sequence with at least ``decompress_min_tokens`` new
tokens attend over decompressed keys and values, decode rows through the backend's mla call,
and every sampled row's logits equal the model's decompressed forward over the whole sequence,
under chunked prefill, prefix-cache hits, mixed steps, piecewise graphs and compile.

The threshold is lowered to 4 so that the tiny prompts here qualify (the default is a real
prefill's, ``DECOMPRESS_MIN_NEW_TOKENS``).
"""
import pytest
import torch

from labkit.engine import LLM, SamplingParams, mla_prefill
from labkit.engine.mla import generate_greedy

from mla_cases import mla_model, tiny_mla

THRESHOLD = 4
# a one-token prompt, lengths off every block size, a shared prefix with the first (prefix hits)
PROMPTS = [list(range(1, 23)), [7], list(range(40, 49)), list(range(1, 17)) + [90, 91, 92, 93, 94],
           [5, 6, 7]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    m = mla_model(tiny_mla(q_lora_rank=24), 5)
    m.decompress_min_tokens = THRESHOLD
    return m


@pytest.fixture(scope="module")
def expected(model):
    return [generate_greedy(model, p, MAX_TOKENS, absorbed=False) for p in PROMPTS]


@pytest.fixture
def paths(monkeypatch):
    """Each call of either path: (path, the new tokens of each sequence it was given)."""
    calls = []
    for name, cu_at in (("absorbed_attention", 4), ("decompressed_attention", 3)):
        real = getattr(mla_prefill, name)

        def call(attention, *args, _real=real, _name=name, _cu=cu_at, **kwargs):
            calls.append((_name.split("_")[0], args[_cu].diff().tolist()))
            return _real(attention, *args, **kwargs)
        monkeypatch.setattr(mla_prefill, name, call)
    return calls


def run(model, prompts=PROMPTS, **options):
    """(greedy tokens per prompt, each step's sampled rows as (request, position, logits))."""
    llm = LLM(model, device="cpu", **options)
    rows, execute = [], llm.runner.execute

    def recording(step, *args, **kwargs):
        result = execute(step, *args, **kwargs)
        sampled = [r for r in step.rows if r.needs_logits]
        rows.extend((r.request, r.start + r.num_tokens - 1, logits)
                    for r, logits in zip(sampled, result.logits))
        return result
    llm.runner.execute = recording
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    return [o.token_ids for o in outs], rows, llm


def assert_logits_equal_the_decompressed_forward(model, rows):
    for request, position, logits in rows:
        tokens = (request.prompt_token_ids + request.output_token_ids)[: position + 1]
        want = model(torch.tensor([tokens]))[0, -1]
        err = (logits - want).abs().max().item()
        assert err < 1e-4 * want.abs().max().item(), \
            f"{request.request_id} at {position}: error {err:.2e}"


@pytest.mark.parametrize("options", [
    dict(),
    dict(max_num_batched_tokens=8, max_num_seqs=4, block_size=4),  # chunks, mixed steps
    dict(backend="triton", max_num_batched_tokens=16, max_num_seqs=4),
], ids=["whole-prompts", "chunked-mixed", "triton"])
def test_sampled_logits_and_tokens_equal_the_decompressed_forward(model, expected, options):
    tokens, rows, llm = run(model, **options)
    assert tokens == expected
    assert_logits_equal_the_decompressed_forward(model, rows)
    if "max_num_batched_tokens" in options:
        assert any(s.stats.num_prefill_tokens and s.stats.num_decode_tokens
                   for s in llm.step_history), "no mixed step ran"


def test_prefix_cache_hits_are_read_into_the_decompressed_keys(model, expected, paths):
    """The fourth prompt shares the first's first 16 tokens: after the first is served, those
    blocks are hits, and its prefill of the other 5 attends decompressed over keys that come
    partly from rows it never wrote."""
    llm = LLM(model, device="cpu", block_size=4)
    first = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=MAX_TOKENS))
    again = llm.generate(PROMPTS[3:4], SamplingParams(max_tokens=MAX_TOKENS))
    assert [first[0].token_ids, again[0].token_ids] == [expected[0], expected[3]]
    assert llm.stats.prefix_hit_tokens >= 16
    assert ("decompressed", [5]) in paths


def test_prefill_rows_go_decompressed_and_decode_rows_absorbed(model, expected, paths):
    tokens, _, _ = run(model, max_num_batched_tokens=8, max_num_seqs=4, block_size=4)
    assert tokens == expected
    decompressed = [n for path, lens in paths if path == "decompressed" for n in lens]
    absorbed = [n for path, lens in paths if path == "absorbed" for n in lens]
    assert decompressed and min(decompressed) >= THRESHOLD
    assert absorbed and max(absorbed) < THRESHOLD and 1 in absorbed
    # a mixed step: one layer's call of each path back to back
    assert any({a[0], b[0]} == {"absorbed", "decompressed"} for a, b in zip(paths, paths[1:]))


def test_switched_off_every_row_is_absorbed(model, expected, paths):
    model.decompress_min_tokens = None
    try:
        tokens, _, _ = run(model)
    finally:
        model.decompress_min_tokens = THRESHOLD
    assert tokens == expected and {p for p, _ in paths} == {"absorbed"}


@pytest.mark.parametrize("options", [
    dict(cudagraph_mode="piecewise"),
    dict(compile=True, cudagraph_mode="none"),
    dict(compile=True, cudagraph_mode="piecewise"),
], ids=["piecewise", "compile", "compile-piecewise"])
def test_graphs_and_compile_branch_on_the_steps_real_rows(model, expected, paths, options):
    tokens, rows, llm = run(model, max_num_batched_tokens=16, max_num_seqs=4, **options)
    assert tokens == expected
    assert_logits_equal_the_decompressed_forward(model, rows)
    assert {"absorbed", "decompressed"} <= {p for p, _ in paths}
    if options["cudagraph_mode"] == "piecewise":
        assert "piecewise" in {s.graph for s in llm.step_history}


# --- on a GPU: the triton backend in bf16 and float32, every graph mode ----------------------

@pytest.mark.gpu  # float32: IEEE dots, rounding order only (TF32 dots came to about 1e-3)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("mode", ["none", "full_and_piecewise"])
def test_gpu_engine_prefill_logits_equal_the_decompressed_forward(dtype, tol, mode):
    reference = mla_model(tiny_mla(q_lora_rank=24), 5).to("cuda")
    model = mla_model(tiny_mla(q_lora_rank=24), 5).to("cuda", dtype)
    model.decompress_min_tokens = THRESHOLD
    llm = LLM(model, cudagraph_mode=mode, max_num_batched_tokens=16, max_num_seqs=4)
    assert llm.backend == "triton"
    rows, execute = [], llm.runner.execute

    def recording(step, *args, **kwargs):
        result = execute(step, *args, **kwargs)
        sampled = [r for r in step.rows if r.needs_logits]
        rows.extend((r.request, r.start + r.num_tokens - 1, logits.float())
                    for r, logits in zip(sampled, result.logits))
        return result
    llm.runner.execute = recording
    llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    for request, position, logits in rows:
        tokens = (request.prompt_token_ids + request.output_token_ids)[: position + 1]
        want = reference(torch.tensor([tokens], device="cuda"))[0, -1]
        err = ((logits - want).abs().max() / want.abs().max()).item()
        assert err < tol, f"{dtype} {mode} {request.request_id} at {position}: {err:.2e}"
