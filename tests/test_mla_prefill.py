"""MLA prefill by decompression (labkit.engine.mla_prefill): a paged step sends each sequence
with enough new tokens through decompressed keys and values and every other one through the
absorbed kernel, and the logits equal the model's decompressed forward over whole sequences.

Sizes are interpreter-sized (kv_lora_rank 32, rope 16); on CPU everything runs in float32. The
threshold is lowered (``decompress_min_tokens``) so that prompts of a few tokens qualify.
"""
import pytest
import torch

import labkit  # noqa: F401
from labkit.engine import mla_prefill
from labkit.engine.mla import generate_greedy
from labkit.engine.mla_prefill import (causal_attention_varlen, context_slots,
                                       decompressed_attention, split_sequences)

from attention_cases import cu_seqlens, fresh_seed
from mla_cases import mla_model, tiny_mla

BLOCK = 8  # divides none of the lengths below


def paged_case(seed: int, totals: list[int], shared_prefix_blocks: int = 0):
    """Token ids of each sequence, block tables scattered over a pool with spares, and a latent
    cache. With ``shared_prefix_blocks``, the last sequence repeats the first's first blocks of
    tokens and its table points at the first's blocks there: a prefix-cache hit."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in totals]
    blocks = max(totals) // BLOCK + 1
    pool = torch.randperm(len(totals) * blocks + 5, generator=g)
    tables = pool[: len(totals) * blocks].view(len(totals), blocks).int()
    if shared_prefix_blocks:
        shared = shared_prefix_blocks * BLOCK
        seqs[-1][:shared] = seqs[0][:shared]
        tables[-1, :shared_prefix_blocks] = tables[0, :shared_prefix_blocks]
    return seqs, tables


def run_steps(model, seqs, tables, schedule, backend="triton"):
    """Runs ``schedule`` (per step, each sequence's new tokens) through forward_paged and checks
    every step's logits against the decompressed forward over the whole sequence."""
    expected = [model(s[None])[0] for s in seqs]
    cache = model.latent_cache(int(tables.max()) + 1, BLOCK)
    done = [0] * len(seqs)
    for step, new in enumerate(schedule):
        ids = torch.cat([seqs[i][done[i]: done[i] + n] for i, n in enumerate(new)])
        lens = torch.tensor([d + n for d, n in zip(done, new)], dtype=torch.int32)
        logits = model.forward_paged(ids, cache, tables, cu_seqlens(new), lens, backend=backend)
        want = torch.cat([expected[i][done[i]: done[i] + n] for i, n in enumerate(new)])
        err = (logits - want).abs().max().item()
        assert err < 1e-4 * want.abs().max().item(), f"step {step} {new}: error {err:.2e}"
        done = [d + n for d, n in zip(done, new)]
    return cache


@pytest.fixture
def model():
    seed = fresh_seed()
    m = mla_model(tiny_mla(q_lora_rank=24), seed)
    m.decompress_min_tokens = 4
    return m


@pytest.fixture
def paths(monkeypatch):
    """Each call of either path, as (path, its rows, its sequences' new tokens)."""
    calls = []

    def spy(name):
        real = getattr(mla_prefill, name)

        def call(attention, *args, **kwargs):
            q, cu = (args[0], args[3]) if name == "decompressed_attention" else (args[1], args[4])
            calls.append((name.split("_")[0], len(q), cu.diff().tolist()))
            return real(attention, *args, **kwargs)
        monkeypatch.setattr(mla_prefill, name, call)
    spy("absorbed_attention")
    spy("decompressed_attention")
    return calls


# --- the logits of every step equal the decompressed forward --------------------------------

@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_chunked_prefill_and_a_mixed_step_equal_the_decompressed_forward(model, backend):
    """A 13-token prompt in chunks of 6 and 7 (the second attends to the first's rows in the
    cache), a one-token prompt and a 9-token prompt; then a step mixing the second chunk with
    two decodes; then decodes."""
    seqs, tables = paged_case(fresh_seed(), [15, 3, 11])
    run_steps(model, seqs, tables, [[6, 1, 9], [7, 1, 1], [1, 1, 1], [1, 0, 0]], backend)


def test_a_prefix_cache_hit_is_read_from_the_blocks_another_sequence_wrote(model):
    """The last sequence's first two blocks are the first's: its prefill starts past them, so
    its decompressed keys come from rows no step of its own wrote."""
    seqs, tables = paged_case(fresh_seed(), [21, 5, 22], shared_prefix_blocks=2)
    cache = run_steps(model, seqs, tables, [[21, 0, 0]])
    expected = model(seqs[2][None])[0]
    lens = torch.tensor([22], dtype=torch.int32)
    logits = model.forward_paged(seqs[2][16:], cache, tables[2:], cu_seqlens([6]), lens)
    err = (logits - expected[16:]).abs().max().item()
    assert err < 1e-4 * expected.abs().max().item(), f"error {err:.2e}"


def test_a_step_past_the_end_of_a_prompt_is_refused_naming_input_ids(model):
    """The second step asks for a sixth token of a five-token prompt: slicing gives one token
    too few, so the tokens no longer match the lengths the positions come from."""
    seqs, tables = paged_case(fresh_seed(), [5, 3])
    run_steps(model, seqs, tables, [[5, 1]])
    ids = torch.cat([seqs[0][5:6], seqs[1][1:2]])  # seqs[0] has no token 5
    with pytest.raises(ValueError, match=r"input_ids has \(1,\) tokens .* 2 new ones"):
        model.forward_paged(ids, model.latent_cache(int(tables.max()) + 1, BLOCK), tables,
                            cu_seqlens([1, 1]), torch.tensor([6, 2], dtype=torch.int32))


@pytest.mark.parametrize("prompt_len", [1, 4, 7, 17])
def test_greedy_tokens_equal_the_decompressed_forward(model, prompt_len):
    g = torch.Generator().manual_seed(fresh_seed())
    prompt = torch.randint(0, 128, (prompt_len,), generator=g).tolist()
    paged = generate_greedy(model, prompt, 6, block_size=BLOCK)
    assert paged == generate_greedy(model, prompt, 6, absorbed=False)


# --- which rows take which path ---------------------------------------------------------------

def test_prefill_rows_go_decompressed_and_decode_rows_absorbed(model, paths):
    seqs, tables = paged_case(fresh_seed(), [15, 3, 11])
    run_steps(model, seqs, tables, [[6, 1, 9], [7, 1, 1], [1, 1, 1]])
    layers = model.config.num_hidden_layers
    assert paths == layers * [("absorbed", 1, [1]), ("decompressed", 15, [6, 9])] + \
        layers * [("absorbed", 2, [1, 1]), ("decompressed", 7, [7])] + \
        layers * [("absorbed", 3, [1, 1, 1])]


def test_below_the_threshold_or_switched_off_every_row_is_absorbed(model, paths):
    seqs, tables = paged_case(fresh_seed(), [15, 3, 11])
    model.decompress_min_tokens = 7
    run_steps(model, seqs, tables, [[6, 1, 3]])
    model.decompress_min_tokens = None
    run_steps(model, seqs, tables, [[9, 2, 11]])
    assert {p for p, _, _ in paths} == {"absorbed"}
    assert mla_prefill.DECOMPRESS_MIN_NEW_TOKENS > 7  # the default is a prefill's, not a test's


def test_the_split_sends_sequences_by_their_new_tokens():
    assert split_sequences([1, 0, 5, 4, 3], 4) == ([0, 4], [2, 3])
    assert split_sequences([1, 9], None) == ([0, 1], [])


# --- the pieces ---------------------------------------------------------------------------------

def test_context_slots_cover_each_sequences_whole_context_through_its_table():
    tables = torch.tensor([[3, 0, 1], [2, 5, 4]], dtype=torch.int32)
    slots, cu_k = context_slots(tables, [1], [0, 6], block_size=4)
    assert slots.tolist() == [8, 9, 10, 11, 20, 21] and cu_k.tolist() == [0, 6]
    slots, cu_k = context_slots(tables, [0, 1], [5, 1], block_size=4)
    assert slots.tolist() == [12, 13, 14, 15, 0, 8] and cu_k.tolist() == [0, 5, 6]


def test_the_torch_fallback_and_flash_attention_agree_with_more_keys_than_queries():
    """New tokens at the end of a longer context (query i sees keys up to len_k - len_q + i)."""
    g = torch.Generator().manual_seed(fresh_seed())
    attention = type("Layer", (), {"scale": 0.2})()
    lens_q, lens_k = [3, 1, 6], [10, 7, 6]
    q = torch.randn(sum(lens_q), 2, 40, generator=g)
    k = torch.randn(sum(lens_k), 2, 40, generator=g)
    v = torch.randn(sum(lens_k), 2, 20, generator=g)
    args = (attention, q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q))
    torch_out = decompressed_attention(*args, flash=False)
    flash_out = decompressed_attention(*args, flash=True)
    assert flash_out.shape == torch_out.shape == (10, 2, 20)
    assert (flash_out - torch_out).abs().max() < 1e-4
    # the first query of the first sequence sees only the first eight of its ten keys
    alone = causal_attention_varlen(q[:1], k[:8], v[:8], cu_seqlens([1]), 0.2, cu_seqlens([8]))
    assert (torch_out[:1] - alone).abs().max() < 1e-5


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "ieee"), (torch.bfloat16, "tf32")])
def test_both_paths_take_float32_as_ieee_dots_not_tf32(monkeypatch, model, dtype, precision):
    """What each kernel is told: Triton's interpreter computes every dot in full precision, but
    a GPU's default takes float32 as TF32, about 1e-3 off, enough to flip a greedy token."""
    from labkit.kernels import flash_attention as flash_file, paged_mla_attention as mla_file
    told = []

    class Launch:  # stands for a kernel: records the precision it is launched with
        def __getitem__(self, grid):
            return lambda *args, **kwargs: told.append(kwargs["PRECISION"])
    monkeypatch.setattr(flash_file, "flash_fwd_kernel", Launch())
    monkeypatch.setattr(mla_file, "paged_mla_kernel", Launch())
    model.to(dtype)
    seqs, tables = paged_case(fresh_seed(), [6, 1])
    model.forward_paged(torch.cat(seqs), model.latent_cache(int(tables.max()) + 1, BLOCK),
                        tables, cu_seqlens([6, 1]), torch.tensor([6, 1], dtype=torch.int32))
    layers = model.config.num_hidden_layers
    assert told == [precision, precision] * layers  # the one-token prompt absorbed, then flash


# --- on a GPU: labkit's kernels in bf16 and float32 -------------------------------------------

# float32's dots are IEEE float32, so only the order of the sums differs from torch's: TF32 dots
# (10-bit mantissas) came to about 1e-3 here.
FLOAT32_TOL = 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FLOAT32_TOL), (torch.bfloat16, 5e-2)])
def test_gpu_paged_steps_equal_the_decompressed_forward(dtype, tol):
    """A 41-token prompt in chunks of 17 and 23 then a decode, a 70-token prompt in chunks of 33
    and 37, a 3-token prompt a token a step, and a one-token prompt: labkit's kernels in
    ``dtype`` against the float32 decompressed forward."""
    seed = fresh_seed()
    reference = mla_model(tiny_mla(q_lora_rank=24), seed).to("cuda")
    model = mla_model(tiny_mla(q_lora_rank=24), seed).to("cuda", dtype)
    model.decompress_min_tokens = 4
    seqs, tables = paged_case(seed, [41, 3, 70, 1])
    seqs, tables = [s.cuda() for s in seqs], tables.cuda()
    expected = [reference(s[None])[0] for s in seqs]
    cache = model.latent_cache(int(tables.max()) + 1, BLOCK)
    done = [0, 0, 0, 0]
    for new in ([17, 1, 33, 1], [23, 1, 37, 0], [1, 1, 0, 0]):
        ids = torch.cat([seqs[i][done[i]: done[i] + n] for i, n in enumerate(new)])
        lens = torch.tensor([d + n for d, n in zip(done, new)], dtype=torch.int32, device="cuda")
        logits = model.forward_paged(ids, cache, tables, cu_seqlens(new, "cuda"), lens).float()
        want = torch.cat([expected[i][done[i]: done[i] + n] for i, n in enumerate(new)])
        err = ((logits - want).abs().max() / want.abs().max()).item()
        assert err < tol, f"seed {seed} {dtype} step {new}: relative error {err:.2e}"
        done = [d + n for d, n in zip(done, new)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FLOAT32_TOL), (torch.bfloat16, 2e-2)])
def test_gpu_decompressed_rows_equal_the_absorbed_kernel_at_deepseek_widths(dtype, tol):
    """One step at DeepSeek-V3's attention widths (latent 512 + 64, keys 128 + 64, values 128;
    16 heads): a 300-token chunk after 200 cached tokens, a decode and a 1,100-token prompt,
    split, against every row through the absorbed kernel."""
    from labkit.attention import paged_mla_attention
    from labkit.engine import ModelConfig
    from labkit.engine.mla import MLAAttention
    from labkit.engine.mla_prefill import latent_step_attention
    config = ModelConfig.tiny(hidden_size=256, num_attention_heads=16, num_key_value_heads=16,
                              kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                              v_head_dim=128, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(fresh_seed())
    attention = MLAAttention(config, device="cuda", dtype=dtype)
    torch.nn.init.normal_(attention.kv_b_proj.weight, std=0.05)
    lens_q, seq_lens, block = [300, 1, 1100], [500, 77, 1100], 64
    blocks = -(-max(seq_lens) // block)
    cache = torch.randn(3 * blocks + 2, block, 576, generator=g).to("cuda", dtype)
    tables = torch.randperm(3 * blocks, generator=g).view(3, blocks).int().cuda()
    q = torch.randn(sum(lens_q), 16, 192, generator=g).to("cuda", dtype)
    cu, lens = cu_seqlens(lens_q, "cuda"), torch.tensor(seq_lens, dtype=torch.int32,
                                                         device="cuda")
    outs = {}
    for name, threshold in (("split", 256), ("absorbed", None)):
        step = latent_step_attention(lambda i: attention, lambda i: cache, lambda i, r: None,
                                     paged_mla_attention, tables, cu, lens, max_query_len=1100,
                                     min_new_tokens=threshold, flash=True)
        outs[name] = step(0, q, q.new_zeros(q.shape[0], 1, 576)).float()
    err = ((outs["split"] - outs["absorbed"]).abs().max() / outs["absorbed"].abs().max()).item()
    assert err < tol, f"{dtype}: relative difference {err:.2e}"
