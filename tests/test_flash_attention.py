"""labkit's flash_attention (varlen prefill, GQA, sliding window) against its float64 reference.

On CPU the kernel runs in Triton's interpreter (float32/float16, small shapes); the tests marked
``gpu`` run bf16 on a real GPU. Every test draws fresh random inputs from a seed it prints on
failure, so a failure can be replayed. paged_attention's tests: test_attention_kernels.py.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit  # noqa: F401
from labkit.attention import flash_attention, flash_attention_ref

from attention_cases import CPU_TOL, cu_seqlens, fresh_seed, max_err, packed, rel_err

# --- flash_attention (interpreter) ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flash_matches_reference_on_a_ragged_gqa_batch(dtype):
    seed = fresh_seed()
    lens = [37, 1, 0, 18]  # not multiples of the 16-wide tiles, one token, one empty
    args = packed(lens, lens, 4, 2, 64, dtype, seed)
    err = max_err(flash_attention(*args), flash_attention_ref(*args))
    assert err < CPU_TOL[dtype], f"seed {seed}: causal GQA 4/2 {dtype} max error {err:.2e}"


def test_flash_causal_mask_is_aligned_to_the_end_of_the_keys():
    seed = fresh_seed()
    # 5 queries after 40 keys see keys up to 35+i; 20 queries over 12 keys: the first 8 see none
    args = packed([5, 20], [40, 12], 2, 2, 64, torch.float32, seed)
    out, ref = flash_attention(*args), flash_attention_ref(*args)
    assert max_err(out, ref) < 2e-4, f"seed {seed}: end-aligned causal mask differs"
    assert out[5:13].abs().max() == 0, "queries that come before every key must return zeros"


def test_flash_sliding_window_sees_only_the_most_recent_keys():
    seed = fresh_seed()
    args = packed([33, 50], [33, 70], 4, 1, 64, torch.float32, seed)  # MQA as well
    err = max_err(flash_attention(*args, window=9), flash_attention_ref(*args, window=9))
    assert err < 2e-4, f"seed {seed}: window 9 max error {err:.2e}"


def test_flash_non_causal_with_a_custom_scale():
    seed = fresh_seed()
    args = packed([20, 3], [9, 31], 2, 2, 64, torch.float32, seed)
    err = max_err(flash_attention(*args, causal=False, scale=0.3),
                  flash_attention_ref(*args, causal=False, scale=0.3))
    assert err < 2e-4, f"seed {seed}: non-causal max error {err:.2e}"


@pytest.mark.parametrize("head_dim", [128, 256])
def test_flash_large_head_dims(head_dim):
    seed = fresh_seed()
    args = packed([17], [17], 2, 1, head_dim, torch.float32, seed)
    err = max_err(flash_attention(*args), flash_attention_ref(*args))
    assert err < 2e-4, f"seed {seed}: head_dim {head_dim} max error {err:.2e}"


HEADS = st.sampled_from([(1, 1), (2, 2), (4, 1), (4, 2), (8, 2)])  # MHA, GQA and MQA


@pytest.mark.parametrize("tma", [True, False], ids=["descriptors", "pointers"])
@settings(max_examples=6, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=4),
       heads=HEADS, window=st.one_of(st.none(), st.integers(1, 30)), seed=st.integers(0, 2**31))
def test_flash_on_random_shapes(tma, lens, heads, window, seed):
    lens_q = [q for q, _ in lens]
    lens_k = [k for _, k in lens]
    args = packed(lens_q, lens_k, *heads, 64, torch.float32, seed)
    if sum(lens_k) == 0:  # no keys at all: nothing for a descriptor to describe
        tma = None
    err = max_err(flash_attention(*args, window=window, tma=tma),
                  flash_attention_ref(*args, window=window))
    assert err < 2e-4, f"lengths {lens}, heads {heads}, window {window}: max error {err:.2e}"


def test_flash_descriptors_read_q_k_v_sliced_from_one_fused_projection():
    """A fused QKV projection gives q, k, v as views with a wide row stride: descriptors address
    them as they are; a head_dim slice (heads not packed) falls back to pointers."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    lens = [23, 9]
    qkv = torch.randn(sum(lens), 4 + 2 + 2, 32, generator=g)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    cu = cu_seqlens(lens)
    ref = flash_attention_ref(q, k, v, cu, cu)
    assert max_err(flash_attention(q, k, v, cu, cu, tma=True), ref) < 2e-4, f"seed {seed}"
    wide = torch.randn(sum(lens), 4, 64, generator=g)[:, :, :32]  # stride(1) = 64, not 32
    ref = flash_attention_ref(wide, k, v, cu, cu)
    assert max_err(flash_attention(wide, k, v, cu, cu), ref) < 2e-4, f"seed {seed}: fallback"
    with pytest.raises(ValueError, match="stride\\(1\\) == head_dim"):
        flash_attention(wide, k, v, cu, cu, tma=True)


@pytest.mark.parametrize("tma", [True, False], ids=["descriptors", "pointers"])
def test_flash_never_reads_the_next_sequence_into_this_one(tma):
    """A key tile runs past a short sequence into its neighbour's rows (a descriptor loads whole
    tiles): those rows must weigh exactly nothing, even when they hold inf."""
    seed = fresh_seed()
    q, k, v, cu_q, cu_k = packed([5, 3], [5, 30], 2, 1, 16, torch.float32, seed)
    k[5:], v[5:] = float("inf"), float("inf")  # sequence 1's keys and values
    out = flash_attention(q, k, v, cu_q, cu_k, tma=tma)
    ref = flash_attention_ref(q[:5], k[:5], v[:5], cu_q[:2], cu_k[:2])
    assert max_err(out[:5], ref) < 2e-4, f"seed {seed}: sequence 0 saw sequence 1's rows"


# --- on a GPU: bf16 against float64 ------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,hq,hkv,window", [(64, 8, 8, None), (128, 32, 8, None),
                                                     (128, 16, 2, 256), (256, 8, 1, None)])
@pytest.mark.parametrize("tma", [None, False], ids=["auto", "pointers"])
def test_gpu_flash_bf16_relative_error_below_1e_2(head_dim, hq, hkv, window, tma):
    seed = fresh_seed()
    lens_q, lens_k = [1000, 1, 0, 257, 129], [1000, 700, 5, 300, 129]
    args = packed(lens_q, lens_k, hq, hkv, head_dim, torch.bfloat16, seed, "cuda")
    err = rel_err(flash_attention(*args, window=window, tma=tma),
                  flash_attention_ref(*args, window=window))
    assert err < 1e-2, f"seed {seed}: bf16 D{head_dim} {hq}/{hkv} window {window}: {err:.2e}"


def test_flash_configs_that_would_not_fit_shared_memory_are_dropped_before_compiling():
    """At head_dim 256 a float32 tile is twice bf16's: the configs the GPU would refuse go
    before the autotuner compiles them, and bf16 keeps every config that fits."""
    import triton
    from labkit.kernels.flash_attention import fits_in_shared_memory
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
               for m, n, w, st in ((128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3),
                                   (64, 32, 4, 2))]
    shapes = {}
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.empty(1, 1, 256, dtype=dtype)
        kept = fits_in_shared_memory(configs, {"Q": q, "HEAD_DIM": 256})
        shapes[dtype] = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in kept]
    assert shapes[torch.float32] == [(64, 32)]
    assert shapes[torch.bfloat16] == [(64, 64), (64, 32)]
