"""paged_mla_attention against its float64 reference, and the absorption algebra it rests on.

On CPU the kernel runs in Triton's interpreter (float32/float16, small widths); the tests marked
``gpu`` run DeepSeek's widths (kv_lora_rank 512, rope 64) in bf16 and float32, and inside a
CUDA Graph. Every random test prints its seed on failure, so a failure can be replayed.
"""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit  # noqa: F401
from labkit.attention import paged_attention_ref, paged_mla_attention, paged_mla_attention_ref

from attention_cases import captured, cu_seqlens, fresh_seed, max_err, rel_err

RANK, ROPE = 32, 16          # interpreter-sized latent and rotary widths (DeepSeek: 512, 64)
SCALE = 1 / math.sqrt(24 + ROPE)  # the model's: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)
TOL = {torch.float32: 1e-4, torch.float16: 4e-3}


def mla_batch(lens_q, seq_lens, heads, block_size, dtype, seed, *, rank=RANK, rope=ROPE,
              device="cpu", spare_blocks=1):
    """A paged latent cache whose blocks are scattered, and the absorbed queries for it."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = max([math.ceil(n / block_size) for n in seq_lens] + [0]) + spare_blocks
    num_blocks = len(seq_lens) * width + 3
    table = torch.randperm(num_blocks, generator=g)[: len(seq_lens) * width]
    table = table.reshape(len(seq_lens), width).int().to(device)
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=g).to(device, dtype)
    q_latent = torch.randn(sum(lens_q), heads, rank, generator=g).to(device, dtype)
    q_rope = torch.randn(sum(lens_q), heads, rope, generator=g).to(device, dtype)
    return (q_latent, q_rope, cache, table, cu_seqlens(lens_q, device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device))


@st.composite
def mixed_batches(draw):
    """A batch mixing decodes, verify-sized queries, chunks and idle sequences, lengths off the
    block size, and a head count that leaves a group part-filled."""
    n = draw(st.integers(1, 4))
    seq_lens = draw(st.lists(st.integers(0, 70), min_size=n, max_size=n))
    lens_q = [draw(st.integers(0, min(s, 20))) for s in seq_lens]
    return (lens_q, seq_lens, draw(st.sampled_from([1, 3, 16, 20])),
            draw(st.sampled_from([8, 16])), draw(st.sampled_from([None, 1, 3])),
            draw(st.booleans()))


@settings(max_examples=12, deadline=None)
@given(mixed_batches(), st.integers(0, 2**32 - 1))
def test_mla_matches_the_reference_on_random_mixed_batches(case, seed):
    lens_q, seq_lens, heads, block_size, num_splits, causal = case
    args = mla_batch(lens_q, seq_lens, heads, block_size, torch.float32, seed)
    out = paged_mla_attention(*args, scale=SCALE, causal=causal, num_splits=num_splits)
    ref = paged_mla_attention_ref(*args, scale=SCALE, causal=causal)
    err = max_err(out, ref)
    assert err < TOL[torch.float32], f"seed {seed} case {case}: max error {err:.2e}"


def _planned(args, keys_on_m, num_splits=None, causal=True):
    """paged_mla_attention's launch with the tile orientation forced."""
    from labkit.kernels.paged_mla_attention import plan_mla
    q_latent, q_rope, cache, table, cu, lens = args
    plan = plan_mla(q_latent.shape[1], q_latent.shape[2], cache.shape, table.shape[0],
                    max(int(lens.max()), 1) if lens.numel() else 1,
                    int((cu[1:] - cu[:-1]).max()) if lens.numel() else 0, q_latent.device,
                    scale=SCALE, causal=causal, num_splits=num_splits, dtype=q_latent.dtype,
                    keys_on_m=keys_on_m)
    assert plan.consts["KEYS_ON_M"] is keys_on_m
    return plan.run(*args)


@settings(max_examples=8, deadline=None)
@given(mixed_batches(), st.sampled_from([None, 32]), st.integers(0, 2**32 - 1))
def test_both_tile_orientations_match_the_reference(case, wide_blocks, seed):
    """Keys on M (S^T = C_kv Q^T) and rows on M compute the same attention on mixed batches,
    split or not, causal or not; blocks of 32 put two 16-key tiles in one block, so a tile's
    offset inside its block counts."""
    lens_q, seq_lens, heads, block_size, num_splits, causal = case
    args = mla_batch(lens_q, seq_lens, heads, wide_blocks or block_size, torch.float32, seed)
    ref = paged_mla_attention_ref(*args, scale=SCALE, causal=causal)
    for keys_on_m in (True, False):
        err = max_err(_planned(args, keys_on_m, num_splits, causal), ref)
        assert err < TOL[torch.float32], f"seed {seed} case {case} keys_on_m {keys_on_m}: {err}"


def test_decode_runs_keys_on_m_and_a_bad_orientation_is_refused():
    from labkit.kernels.paged_mla_attention import plan_mla
    decode = plan_mla(16, RANK, (9, 16, RANK + ROPE), 4, 70, 1, "cpu", scale=SCALE)
    chunk = plan_mla(16, RANK, (9, 16, RANK + ROPE), 4, 70, 7, "cpu", scale=SCALE)
    assert decode.consts["KEYS_ON_M"] and not chunk.consts["KEYS_ON_M"]
    with pytest.raises(TypeError, match="keys_on_m must be True or False"):
        plan_mla(16, RANK, (9, 16, RANK + ROPE), 4, 70, 1, "cpu", scale=SCALE, keys_on_m="yes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_mla_decode_verify_chunk_and_idle_in_one_batch(dtype, num_splits):
    seed = fresh_seed()
    args = mla_batch([1, 4, 0, 19, 1], [70, 33, 5, 40, 1], 16, 16, dtype, seed)
    err = max_err(paged_mla_attention(*args, scale=SCALE, num_splits=num_splits),
                  paged_mla_attention_ref(*args, scale=SCALE))
    assert err < TOL[dtype], f"seed {seed}: {dtype} splits {num_splits}: {err:.2e}"


def test_absorbed_attention_equals_attention_over_decompressed_keys_and_values():
    """The reason the kernel exists: W_UK folded into the query and W_UV applied after the
    output give what ordinary per-head attention gives over keys [c_kv W_UK_h ; k_pe] and
    values c_kv W_UV_h (checked in float64 through paged_attention_ref)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    heads, nope, block_size = 3, 24, 8
    v_dim = nope + ROPE  # paged_attention_ref returns q's width
    q_latent, q_rope, cache, table, cu, lens = mla_batch([1, 3, 6], [30, 17, 6], heads,
                                                         block_size, torch.float64, seed)
    w_uk = torch.randn(heads, RANK, nope, generator=g, dtype=torch.float64) / RANK ** 0.5
    w_uv = torch.randn(heads, RANK, v_dim, generator=g, dtype=torch.float64) / RANK ** 0.5
    q_nope = torch.randn(q_latent.shape[0], heads, nope, generator=g, dtype=torch.float64)
    # decompressed: per-head keys and values, as a model without absorption would cache them
    c_kv, k_pe = cache[..., :RANK], cache[..., RANK:]
    k_cache = torch.cat([torch.einsum("bsr,hrn->bshn", c_kv, w_uk),
                         k_pe[:, :, None, :].expand(-1, -1, heads, -1)], dim=-1)
    v_cache = torch.einsum("bsr,hrv->bshv", c_kv, w_uv)
    q = torch.cat([q_nope, q_rope], dim=-1)
    decompressed = paged_attention_ref(q, k_cache, v_cache.contiguous(), table, cu, lens,
                                       scale=SCALE)
    # absorbed: W_UK into the query, attention over the latent, W_UV after
    q_absorbed = torch.einsum("thn,hrn->thr", q_nope, w_uk)
    latent_out = paged_mla_attention_ref(q_absorbed, q_rope, cache, table, cu, lens, scale=SCALE)
    absorbed = torch.einsum("thr,hrv->thv", latent_out, w_uv)
    assert max_err(absorbed, decompressed) < 1e-10, f"seed {seed}: the algebra does not hold"
    # and the kernel gives the same as its reference on those absorbed queries
    args = (q_absorbed.float(), q_rope.float(), cache.float(), table, cu, lens)
    assert max_err(paged_mla_attention(*args, scale=SCALE), latent_out) < TOL[torch.float32]


def test_a_query_before_every_key_and_an_idle_batch_give_zeros_and_empties():
    seed = fresh_seed()
    # non-causal over an empty context: nothing to attend to, zeros out
    args = mla_batch([2], [0], 4, 16, torch.float32, seed)
    args = (*args[:5], torch.tensor([2], dtype=torch.int32))  # 2 new tokens, cache of 2
    out = paged_mla_attention(*args, scale=SCALE)
    assert max_err(out, paged_mla_attention_ref(*args, scale=SCALE)) < 1e-4
    empty = mla_batch([0, 0], [5, 9], 4, 16, torch.float32, seed)
    assert paged_mla_attention(*empty, scale=SCALE).shape == (0, 4, RANK)


def test_a_plan_for_a_long_context_spreads_each_short_sequence_over_every_split(monkeypatch):
    """As paged_attention's: a decode graph's plan is made for the longest context its tables
    hold, and each sequence's keys are dealt over the splits from its own length on the
    device, so a short one still uses every split and every answer matches the reference."""
    from labkit.kernels import paged_mla_attention as module
    seed = fresh_seed()
    lens = [300, 37, 0, 1]
    args = mla_batch([1, 1, 1, 1], lens, 4, 16, torch.float32, seed, spare_blocks=60)
    plan = module.plan_mla(4, RANK, args[2].shape, 4, args[3].shape[1] * 16, 1, "cpu",
                           scale=SCALE, num_splits=4, dtype=torch.float32)
    assert plan.keys_per_split >= 256, "planned for the tables' width, far past 300 tokens"
    seen = {}
    merge = module.merge_splits
    monkeypatch.setattr(module, "merge_splits",
                        lambda partial, lse, out: merge(partial, seen.setdefault("lse", lse), out))
    out = plan.run(*args)
    err = max_err(out, paged_mla_attention_ref(*args, scale=SCALE))
    assert err < TOL[torch.float32], f"seed {seed}: max error {err:.2e}"
    busy = torch.isfinite(seen["lse"]).sum(dim=2)[:, 0].tolist()  # splits that read a key
    bn = plan.consts["BLOCK_N"]
    share = [-(-(-(-n // 4)) // bn) * bn for n in lens]  # a quarter, in whole tiles
    assert busy == [-(-n // s) if n else 0 for n, s in zip(lens, share)], busy
    assert busy[0] == 4 and busy[1] >= 2 and busy[2] == 0, busy


def test_unchecked_calls_with_an_out_buffer_give_the_checked_answer():
    seed = fresh_seed()
    args = mla_batch([1, 3], [40, 21], 8, 16, torch.float32, seed)
    checked = paged_mla_attention(*args, scale=SCALE)
    out = torch.full_like(checked, float("nan"))
    got = paged_mla_attention(*args, scale=SCALE, check=False, max_query_len=3, out=out)
    assert got is out and torch.equal(out, checked), f"seed {seed}: check=False changed it"


def _bad(**change):
    q_latent, q_rope, cache, table, cu, lens = mla_batch([1, 2], [9, 20], 4, 16,
                                                         torch.float32, 0)
    args = dict(q_latent=q_latent, q_rope=q_rope, latent_cache=cache, block_tables=table,
                cu_seqlens_q=cu, seq_lens=lens, scale=SCALE)
    args.update(change)
    return args


@pytest.mark.parametrize("change,error,words", [
    (dict(q_latent=torch.zeros(3, 4, 24)), ValueError, "kv_lora_rank"),
    (dict(q_rope=torch.zeros(3, 4, 8)), ValueError, "qk_rope_head_dim"),
    (dict(q_rope=torch.zeros(3, 2, ROPE)), ValueError, "same tokens and heads"),
    (dict(latent_cache=torch.zeros(10, 16, RANK)), ValueError, "c_kv then k_pe"),
    (dict(latent_cache=torch.zeros(10, 16, RANK + ROPE, dtype=torch.float16)), TypeError,
     "one dtype"),
    (dict(scale=None), ValueError, "scale must be given"),
    (dict(scale=-1.0), ValueError, "scale must be a finite positive"),
    (dict(causal="yes"), TypeError, "causal must be True or False"),
    (dict(block_tables=torch.full((2, 3), 99, dtype=torch.int32)), ValueError, "block ids"),
    (dict(seq_lens=torch.tensor([9, 1], dtype=torch.int32)), ValueError, "seq_lens"),
    (dict(num_splits=0), ValueError, "num_splits"),
    (dict(out=torch.zeros(3, 4, RANK, dtype=torch.float16)), ValueError, "out must be"),
    (dict(q_latent=[[0.0]]), TypeError, "q_latent must be a torch.Tensor"),
])
def test_bad_input_names_the_parameter_and_the_limit(change, error, words):
    with pytest.raises(error, match=words):
        paged_mla_attention(**_bad(**change))


def test_decode_plans_follow_the_h200_sweep(monkeypatch):
    """plan_mla's GPU decode choices, as benchmarks/mla_decode.py --sweep measured them fastest
    on an H200 (132 SMs), checked here with the interpreter switched off for the planner only."""
    from labkit.kernels import paged_mla_attention as mla
    monkeypatch.setattr(mla, "interpreter_on", lambda: False)
    monkeypatch.setattr(mla, "num_sms", lambda device: 132)

    def plan(batch, heads, ctx):
        p = mla.plan_mla(heads, 512, (batch * ctx // 64, 64, 576), batch, ctx, 1, "cpu",
                         scale=1.0)
        return (p.consts["HEADS"], p.consts["BLOCK_N"], p.launch["num_warps"],
                p.launch["num_stages"], p.num_splits, p.consts["KEYS_ON_M"])
    assert plan(64, 128, 4096) == (64, 64, 8, 3, 1, False), "many heads: 64 a program"
    assert plan(1, 128, 32768) == (32, 64, 4, 2, 33, True), "one sequence: 32 a program, 1 wave"
    assert plan(64, 16, 4096) == (16, 64, 4, 2, 2, True), "keys on M, about one program per SM"
    assert plan(1, 16, 32768) == (16, 64, 4, 2, 128, True), "one sequence: 128 splits of 256"
    mixed = mla.plan_mla(128, 512, (4096, 64, 576), 8, 4096, 5, "cpu", scale=1.0)
    assert mixed.consts["HEADS"] * mixed.consts["BLOCK_Q"] == 32, "verify tokens: rows cap at 32"


# What Triton 3.6 allocated compiling each plan below for sm_90 (an H200): (rows, keys per
# tile, bytes an element) -> bytes. The bf16 ones run on the H200; the float32 one that
# failed there (16 rows over 64-key tiles, 315,392 bytes) was TF32's, an IEEE plan takes less.
COMPILED_SHARED_BYTES = {(16, 32, 2): 56320, (16, 64, 2): 94208, (32, 64, 2): 114688,
                         (64, 64, 2): 221696, (16, 32, 4): 112704, (32, 32, 4): 151680,
                         (64, 16, 4): 188800}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_plan_at_deepseek_widths_fits_an_h200_blocks_shared_memory(monkeypatch, dtype):
    """16 and 128 heads, batch 1 and 64, short and long contexts, decode, verify and chunk
    steps: float32 tiles take twice bf16's bytes, so its key tiles may be narrower (nothing
    else changes); its dots are IEEE float32."""
    from labkit.kernels import paged_mla_attention as mla
    monkeypatch.setattr(mla, "interpreter_on", lambda: False)
    monkeypatch.setattr(mla, "num_sms", lambda device: 132)
    element_size = torch.empty((), dtype=dtype).element_size()
    for heads, batch, ctx, new in itertools.product((16, 128), (1, 64), (300, 4096, 32768),
                                                    (1, 5, 300, 1100)):
        p = mla.plan_mla(heads, 512, (batch * ctx // 64 + 1, 64, 576), batch, ctx, new, "cpu",
                         scale=1.0, dtype=dtype)
        bf16 = mla.plan_mla(heads, 512, (batch * ctx // 64 + 1, 64, 576), batch, ctx, new,
                            "cpu", scale=1.0)
        rows, block_n = p.consts["HEADS"] * p.consts["BLOCK_Q"], p.consts["BLOCK_N"]
        need = mla.shared_memory_bytes(rows, block_n, 576, element_size)
        case = f"{heads} heads, batch {batch}, {ctx} keys, {new} new: {need} bytes"
        assert need <= mla.SHARED_MEMORY_BYTES == 232448, case
        assert COMPILED_SHARED_BYTES.get((rows, block_n, element_size), 0) <= need, case
        assert p.consts["PRECISION"] == ("ieee" if dtype == torch.float32 else "tf32")
        assert {**p.consts, "BLOCK_N": 0, "PRECISION": 0} == \
            {**bf16.consts, "BLOCK_N": 0, "PRECISION": 0} and p.launch == bf16.launch, case
        assert block_n <= bf16.consts["BLOCK_N"], case


# --- on a GPU: DeepSeek's widths in bf16, and inside a CUDA Graph -----------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,ctx", [(70, 128, 300), (1, 128, 20000), (1, 16, 20000),
                                             (64, 16, 1000)])
def test_gpu_mla_decode_plans_match_the_reference(batch, heads, ctx):
    """Each decode plan the planner picks (64 heads per program, 32 with splits, 16 with 32- or
    64-key tiles) on lengths off the tile."""
    seed = fresh_seed()
    lens = [ctx - (7 * i) % (ctx // 2) for i in range(batch)]
    args = mla_batch([1] * batch, lens, heads, 64, torch.bfloat16, seed, rank=512, rope=64,
                     device="cuda")
    err = rel_err(paged_mla_attention(*args, scale=192 ** -0.5),
                  paged_mla_attention_ref(*args, scale=192 ** -0.5))
    assert err < 1e-2, f"seed {seed}: batch {batch}, {heads} heads, {ctx} keys: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_both_tile_orientations_at_deepseek_widths(dtype, heads):
    """Keys on M and rows on M on the H200's MMAs (wgmma where a side has 64 rows), decode and
    a mixed batch, split and not."""
    seed = fresh_seed()
    for lens_q, seq_lens in (([1] * 6, [4000, 17, 900, 1200, 3, 64]),
                             ([1, 1, 4, 200, 0], [4000, 17, 900, 1200, 3])):
        args = mla_batch(lens_q, seq_lens, heads, 64, dtype, seed, rank=512, rope=64,
                         device="cuda")
        ref = paged_mla_attention_ref(*args, scale=SCALE)
        for keys_on_m, splits in itertools.product((True, False), (1, 5)):
            err = rel_err(_planned(args, keys_on_m, splits), ref)
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            assert err < tol, f"seed {seed} {lens_q} keys_on_m {keys_on_m} splits {splits}: {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_splits", [1, None, 7])
def test_gpu_mla_bf16_at_deepseek_widths_relative_error_below_1e_2(heads, num_splits):
    seed = fresh_seed()
    args = mla_batch([1, 1, 4, 200, 0], [4000, 17, 900, 1200, 3], heads, 64, torch.bfloat16,
                     seed, rank=512, rope=64, device="cuda")
    err = rel_err(paged_mla_attention(*args, scale=192 ** -0.5, num_splits=num_splits),
                  paged_mla_attention_ref(*args, scale=192 ** -0.5))
    assert err < 1e-2, f"seed {seed}: {heads} heads splits {num_splits}: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("lens_q,seq_lens", [
    ([1, 1, 4, 200, 0], [4000, 17, 900, 1200, 3]),
    ([1] * 40, [300 + 13 * i for i in range(40)]),  # 128 heads: 64-row decode programs
], ids=["mixed", "decode"])
def test_gpu_mla_float32_at_deepseek_widths_is_ieee_float32(heads, lens_q, seq_lens):
    """float32 plans fit the shared memory with their narrower key tiles, and their dots are
    IEEE float32 (TF32's 10-bit mantissas come to around 1e-4 here)."""
    seed = fresh_seed()
    args = mla_batch(lens_q, seq_lens, heads, 64, torch.float32, seed, rank=512, rope=64,
                     device="cuda")
    err = rel_err(paged_mla_attention(*args, scale=192 ** -0.5),
                  paged_mla_attention_ref(*args, scale=192 ** -0.5))
    assert err < 1e-5, f"seed {seed}: {heads} heads: {err:.2e}"


@pytest.mark.gpu
def test_gpu_mla_decode_replays_in_a_cuda_graph_with_new_inputs():
    seed = fresh_seed()
    q_latent, q_rope, cache, table, cu, lens = mla_batch(
        [1, 1, 1, 1], [100, 37, 2048, 9], 16, 64, torch.bfloat16, seed, rank=512, rope=64,
        device="cuda")
    out = torch.empty_like(q_latent)

    def step():  # no host sync: check=False and max_query_len given, as in a captured decode
        paged_mla_attention(q_latent, q_rope, cache, table, cu, lens, scale=192 ** -0.5,
                            check=False, max_query_len=1, out=out)

    graph, _ = captured(step)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    q_latent.copy_(torch.randn(q_latent.shape, generator=g).to("cuda", torch.bfloat16))
    lens.copy_(torch.tensor([90, 64, 1500, 12], dtype=torch.int32))
    graph.replay()
    ref = paged_mla_attention_ref(q_latent, q_rope, cache, table, cu, lens, scale=192 ** -0.5)
    assert rel_err(out, ref) < 1e-2, f"seed {seed}: the replay did not read the new inputs"

