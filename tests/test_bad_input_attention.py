"""The attention kernels refuse bad input with an error that names it, never a wrong answer:
shapes, dtypes, metadata, and the host arguments checked on every call, check=False included."""
import pytest
import torch

import labkit  # noqa: F401
from labkit.attention import flash_attention, paged_attention, paged_attention_ref

from attention_cases import CPU_TOL, FP8, max_err, packed, paged

# --- bad input is an error, never a wrong answer -----------------------------------------------

def test_heads_that_do_not_divide_are_refused():
    args = packed([4], [4], 3, 2, 64, torch.float32, 0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        flash_attention(*args)


def test_a_cache_of_another_dtype_is_refused():
    q, k, v, *rest = paged([1], [5], 2, 2, 64, 16, torch.float32, 0)
    with pytest.raises(TypeError, match="dtype"):
        paged_attention(q, k.half(), v.half(), *rest)


def test_an_fp8_cache_without_scales_is_refused():
    q, k, v, *rest = paged([1], [5], 2, 2, 64, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention(q, k.to(FP8), v.to(FP8), *rest)


def test_a_block_table_too_narrow_for_seq_lens_is_refused():
    q, k, v, table, cu, _ = paged([1], [20], 2, 2, 64, 16, torch.float32, 0, spare_blocks=0)
    too_long = torch.tensor([33], dtype=torch.int32)  # 2 blocks of 16 hold at most 32
    with pytest.raises(ValueError, match="capacity"):
        paged_attention(q, k, v, table, cu, too_long)


def test_block_ids_outside_the_cache_are_refused():
    q, k, v, table, cu, lens = paged([1], [20], 2, 2, 64, 16, torch.float32, 0)
    table[0, 1] = k.shape[0]
    with pytest.raises(ValueError, match="outside"):
        paged_attention(q, k, v, table, cu, lens)


def test_a_non_contiguous_cache_is_refused():
    q, k, v, *rest = paged([1], [5], 2, 2, 64, 16, torch.float32, 0)
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)  # right shape, wrong layout
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention(q, k_t, v, *rest)


def test_cu_seqlens_must_be_int32_and_add_up():
    q, k, v, cu, _ = packed([4, 4], [4, 4], 2, 2, 64, torch.float32, 0)
    with pytest.raises(ValueError, match="int32"):
        flash_attention(q, k, v, cu.long(), cu)
    with pytest.raises(ValueError, match="end at the token count"):
        flash_attention(q, k, v, torch.tensor([0, 4, 7], dtype=torch.int32), cu)


def test_a_window_without_causal_is_refused():
    args = packed([4], [4], 2, 2, 64, torch.float32, 0)
    with pytest.raises(ValueError, match="causal"):
        flash_attention(*args, causal=False, window=2)



def test_a_non_positive_scale_is_refused():
    args = packed([4], [4], 2, 2, 64, torch.float32, 0)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        flash_attention(*args, scale=0.0)



def test_a_max_query_len_shorter_than_a_sequence_is_refused():
    args = paged([1, 5], [10, 12], 2, 2, 64, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_attention(*args, max_query_len=2)


# --- bad input: host arguments are checked on every call, check=False included ---------------

@pytest.mark.parametrize("given", [-1, 0, 9, 10**9])
def test_an_impossible_max_seqlen_q_is_refused_even_unchecked(given):
    args = packed([5, 3], [5, 3], 2, 2, 16, torch.float32, 0)  # 8 queries in 2 sequences
    with pytest.raises(ValueError, match=rf"max_seqlen_q={given}.*between 4 and 8"):
        flash_attention(*args, max_seqlen_q=given, check=False)


@pytest.mark.parametrize("given", [-1, 0, 9])
def test_an_impossible_max_query_len_is_refused_even_unchecked(given):
    args = paged([1, 5], [10, 12], 2, 2, 64, 16, torch.float32, 0)  # 6 new tokens, 2 sequences
    with pytest.raises(ValueError, match=rf"max_query_len={given}.*between 3 and 6"):
        paged_attention(*args, max_query_len=given, check=False)


@pytest.mark.parametrize("given", [1.5, True, "4"])
def test_a_max_seqlen_q_that_is_not_an_int_is_refused(given):
    args = packed([4], [4], 2, 2, 16, torch.float32, 0)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        flash_attention(*args, max_seqlen_q=given, check=False)


@pytest.mark.parametrize("splits", [0, -2, 2.0, True])
def test_a_num_splits_that_is_not_a_positive_int_is_refused_even_unchecked(splits):
    args = paged([1, 5], [10, 12], 2, 2, 64, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        paged_attention(*args, num_splits=splits, check=False, max_query_len=5)


@pytest.mark.parametrize("tuning, message", [
    ({"block_n": 7}, r"tuning\['block_n'\] must be a power of two from 16 to 256, got 7"),
    ({"block_n": 8}, r"tuning\['block_n'\] must be a power of two from 16 to 256, got 8"),
    ({"block_n": 512}, r"tuning\['block_n'\] must be a power of two from 16 to 256"),
    ({"num_warps": 3}, r"tuning\['num_warps'\] must be one of \(1, 2, 4, 8, 16, 32\), got 3"),
    ({"num_stages": 0}, r"tuning\['num_stages'\] must be a positive int"),
    ({"maxnreg": 1000}, r"tuning\['maxnreg'\] must be an int from 24 to 255"),
    ({"prefetch": "no"}, r"tuning\['prefetch'\] must be True or False"),
    ({"blockn": 16}, r"unknown tuning keys \['blockn'\]; known: block_n, num_warps"),
])
def test_a_bad_tuning_override_is_refused_naming_its_key(tuning, message):
    args = paged([1, 5], [10, 12], 2, 2, 64, 16, torch.float32, 0)
    with pytest.raises(ValueError, match=message):
        paged_attention(*args, tuning=tuning)


def test_tuning_must_be_a_dict():
    args = paged([1], [10], 2, 2, 64, 16, torch.float32, 0)
    with pytest.raises(TypeError, match=r"tuning must be a dict such as \{'block_n': 32\}"):
        paged_attention(*args, tuning=[("block_n", 16)])


def test_a_valid_tuning_override_still_gives_the_reference_answer():
    args = paged([1, 5], [10, 40], 4, 2, 64, 16, torch.float32, 0)
    out = paged_attention(*args, tuning={"block_n": 32, "num_warps": 2, "num_stages": 2})
    assert max_err(out, paged_attention_ref(*args)) < CPU_TOL[torch.float32]


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), -1.0])
def test_a_scale_that_is_not_finite_and_positive_is_refused(scale):
    args = packed([4], [4], 2, 2, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        flash_attention(*args, scale=scale)


def test_a_v_of_another_dtype_than_q_is_refused():
    q, k, v, cu_q, cu_k = packed([4], [4], 2, 2, 16, torch.float32, 0)
    with pytest.raises(TypeError, match="k and v must have q's dtype torch.float32, got "
                                        "k torch.float32 and v torch.float16"):
        flash_attention(q, k, v.half(), cu_q, cu_k)


def test_arguments_that_are_not_tensors_are_refused_by_name():
    q, k, v, cu_q, cu_k = packed([4], [4], 2, 2, 16, torch.float32, 0)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        flash_attention(q.tolist(), k, v, cu_q, cu_k)
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.Tensor, got list"):
        flash_attention(q, k, v, cu_q, [0, 4])
    args = list(paged([1], [10], 2, 2, 64, 16, torch.float32, 0))
    args[5] = [10]
    with pytest.raises(TypeError, match="seq_lens must be a torch.Tensor, got list"):
        paged_attention(*args)


@pytest.mark.parametrize("flag, value", [("causal", "no"), ("causal", None), ("tma", "yes")])
def test_flags_that_are_not_bools_are_refused(flag, value):
    args = packed([4], [4], 2, 2, 16, torch.float32, 0)
    with pytest.raises(TypeError, match=f"{flag} must be"):
        flash_attention(*args, **{flag: value})
