"""The PyTorch peers (sdpa, flex) are fair and agree with the reference.

Fair: a layer is one batched call over a padded batch, not a loop over sequences; at decode with
equal lengths SDPA gets no mask and enable_gqa; the lengths reach the host once a call, or not at
all when the engine passes the host copy its step metadata holds; flex compiles for changing
shapes and builds one block mask per batch shape. Both agree with the float64
reference on fresh random batches, awkward ones included. Whose limits they have (every
"no"/"never" of the compatibility matrix labelled): test_attention_limits.py."""
import math
import pathlib
import sys

import pytest
import torch
from attention_cases import CPU_TOL, fresh_seed, max_err, packed, paged
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import labkit  # noqa: F401
from labkit.attention import BACKENDS, flash_attention_ref, paged_attention_ref, peers
from labkit.attention.peers import (
    PaddedBatch,
    flex_block_mask,
    sdpa_call,
    sees_a_key,
    visibility,
)

PEERS = ("sdpa", "flex")


# --- random batches, awkward ones on purpose ----------------------------------------------------

@st.composite
def batches(draw, max_seqs=5):
    """(lens_q, seq_lens, q heads, kv heads, head_dim, block_size, causal, window): one-token
    rows, lengths off the block size, empty rows and caches, GQA/MQA groups, windows."""
    num_seqs = draw(st.integers(1, max_seqs))
    decode = draw(st.booleans())
    seq_lens = draw(st.lists(st.integers(0, 40), min_size=num_seqs, max_size=num_seqs))
    if decode:
        lens_q = [1] * num_seqs
        if draw(st.booleans()):  # the unmasked decode case: every sequence equally long
            seq_lens = [max(1, seq_lens[0])] * num_seqs
    else:
        lens_q = [draw(st.integers(0, n + 2)) for n in seq_lens]
    seq_lens = [max(n, m) for n, m in zip(seq_lens, lens_q)]  # the new tokens are cached too
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4]))
    return (lens_q, seq_lens, num_kv_heads * group, num_kv_heads,
            draw(st.sampled_from([8, 16, 32])), draw(st.sampled_from([1, 4, 16])),
            draw(st.booleans()), draw(st.sampled_from([None, 1, 3, 8, 64])))


def _check_paged(name, lens_q, seq_lens, hq, hkv, d, bs, causal, window, seed):
    args = paged(lens_q, seq_lens, hq, hkv, d, bs, torch.float32, seed)
    kw = {"causal": causal, "window": window}
    err = max_err(BACKENDS[name].paged(*args, **kw), paged_attention_ref(*args, **kw))
    assert err < CPU_TOL[torch.float32], (f"seed {seed}: {name} paged {lens_q} over {seq_lens} "
                                          f"{hq}/{hkv} heads, block {bs}, {kw}: error {err:.2e}")


def _check_packed(name, lens_q, lens_k, hq, hkv, d, causal, window, seed):
    args = packed(lens_q, lens_k, hq, hkv, d, torch.float32, seed)
    kw = {"causal": causal, "window": window}
    err = max_err(BACKENDS[name].flash(*args, **kw), flash_attention_ref(*args, **kw))
    assert err < CPU_TOL[torch.float32], (f"seed {seed}: {name} packed {lens_q} over {lens_k} "
                                          f"{hq}/{hkv} heads, {kw}: error {err:.2e}")


FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(FAST, max_examples=60)
@given(batches(), st.integers(0, 2**31 - 1))
def test_sdpa_agrees_with_the_reference_on_random_batches(batch, seed):
    lens_q, seq_lens, hq, hkv, d, bs, causal, window = batch
    _check_paged("sdpa", lens_q, seq_lens, hq, hkv, d, bs, causal, window, seed)
    _check_packed("sdpa", lens_q, seq_lens, hq, hkv, d, causal, window, seed)


@settings(FAST, max_examples=12)
@given(batches(max_seqs=3), st.integers(0, 2**31 - 1))
def test_flex_agrees_with_the_reference_on_random_batches(batch, seed):
    lens_q, seq_lens, hq, hkv, d, bs, causal, window = batch
    _check_paged("flex", lens_q, seq_lens, hq, hkv, d, bs, causal, window, seed)
    _check_packed("flex", lens_q, seq_lens, hq, hkv, d, causal, window, seed)


AWKWARD = {  # (lens_q, seq_lens, q heads, kv heads, block size, causal, window)
    "one token, one key": ([1], [1], 4, 4, 16, True, None),
    "decode, equal lengths off the block, GQA": ([1, 1, 1], [17, 17, 17], 8, 2, 16, True, None),
    "decode, unequal lengths, MQA": ([1, 1, 1, 1], [1, 33, 16, 5], 4, 1, 16, True, None),
    "decode, window shorter than every sequence": ([1, 1], [40, 23], 4, 2, 4, True, 8),
    "decode, an empty cache row": ([1, 1], [0, 9], 4, 2, 4, True, None),
    "varlen prefill + decode, window": ([7, 1, 0, 3], [7, 29, 5, 40], 8, 2, 16, True, 6),
    "more new tokens than keys (non-causal)": ([5, 2], [5, 2], 2, 1, 1, False, 3),
    "square causal prefill, equal lengths": ([12, 12], [12, 12], 4, 4, 4, True, None),
    "equal chunks over longer caches": ([4, 4], [20, 20], 4, 2, 16, True, None),
}


@pytest.mark.parametrize("name", PEERS)
@pytest.mark.parametrize("case", list(AWKWARD))
def test_peers_agree_with_the_reference_on_awkward_batches(name, case):
    lens_q, seq_lens, hq, hkv, bs, causal, window = AWKWARD[case]
    seed = fresh_seed()
    _check_paged(name, lens_q, seq_lens, hq, hkv, 16, bs, causal, window, seed)
    _check_packed(name, lens_q, seq_lens, hq, hkv, 16, causal, window, seed)


@pytest.mark.parametrize("name", PEERS)
def test_a_batch_where_no_query_sees_a_key_returns_zeros(name):
    args = paged([2, 0], [0, 0], 4, 2, 16, 16, torch.float32, 0)
    assert BACKENDS[name].paged(*args).eq(0).all()
    args = packed([0, 0], [3, 4], 4, 2, 16, torch.float32, 0)
    assert BACKENDS[name].flash(*args).shape == (0, 4, 16)


@pytest.mark.parametrize("lens_q, seq_lens", [([1, 1], [0, 9]), ([3, 1, 2], [2, 6, 0])])
def test_queries_that_see_nothing_are_zeros_whatever_the_kernel_returns(monkeypatch, lens_q,
                                                                        seq_lens):
    real = torch.nn.functional.scaled_dot_product_attention

    def nan_where_blind(q, k, v, attn_mask=None, **kw):  # as a kernel may: NaN for such rows
        out = real(q, k, v, attn_mask=attn_mask, **kw)
        return out if attn_mask is None else out.masked_fill(~attn_mask.any(-1, True), math.nan)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", nan_where_blind)
    args = paged(lens_q, seq_lens, 4, 2, 16, 4, torch.float32, fresh_seed())
    kw = {"window": 2}
    assert max_err(BACKENDS["sdpa"].paged(*args, **kw), paged_attention_ref(*args, **kw)) < 1e-4


@settings(FAST, max_examples=80)
@given(batches())
def test_sees_a_key_is_the_mask_with_a_visible_key(batch):
    lens_q, seq_lens, *_, causal, window = batch
    b = PaddedBatch(tuple(lens_q), tuple(seq_lens), causal, window)
    if b.empty:
        return
    lq, lk = torch.tensor(lens_q), torch.tensor(seq_lens)
    mask = visibility(lq, lk, b.offsets(lk), causal=causal, window=window)(
        torch.arange(len(lens_q))[:, None, None], None, torch.arange(b.q_width)[None, :, None],
        torch.arange(b.k_width)[None, None, :])
    assert torch.equal(sees_a_key(b, lq, lk), mask.any(-1))


# --- the calls the sdpa peer makes ---------------------------------------------------------------

@pytest.mark.parametrize("lens_q, lens_k, causal, window, mask, is_causal, call", [
    ((1, 1, 1), (9, 9, 9), True, None, False, False, "decode: enable_gqa, no mask"),
    ((1, 1), (9, 30), True, None, True, False, "decode with padding"),
    ((1, 1), (40, 23), True, 8, False, False, "decode: enable_gqa, no mask"),  # window fits
    ((1, 1), (40, 5), True, 8, True, False, "decode with padding"),
    ((6, 6), (6, 6), True, None, False, True, "equal lengths"),
    ((6, 6), (6, 6), False, None, False, False, "equal lengths"),
    ((4, 4), (20, 20), True, None, True, False, "varlen"),  # SDPA's causal flag is top-left
    ((6, 6), (6, 6), True, 3, True, False, "varlen"),
    ((3, 1), (9, 30), True, None, True, False, "varlen"),
])
def test_the_padded_batch_needs_a_mask_only_where_sdpa_cannot_do_without(
        lens_q, lens_k, causal, window, mask, is_causal, call):
    b = PaddedBatch(lens_q, lens_k, causal, window)
    assert (b.needs_mask, b.is_causal) == (mask, is_causal)
    assert sdpa_call(b).startswith(call)


def test_decode_with_a_window_gathers_only_the_window():
    b = PaddedBatch((1, 1), (40, 23), True, 8)
    pos = b.key_positions(torch.tensor([40, 23]))
    assert pos.shape == (2, 8) and pos[0].tolist() == list(range(32, 40))


class SdpaCalls:
    """Records every F.scaled_dot_product_attention call (shapes, mask, flags) and every
    host read (.tolist / .item) made while it is active, with the file that made it."""
    def __init__(self, monkeypatch):
        self.calls, self.host_reads, self.readers = [], 0, []
        real, real_tolist, real_item = (torch.nn.functional.scaled_dot_product_attention,
                                        torch.Tensor.tolist, torch.Tensor.item)

        def sdpa(q, k, v, attn_mask=None, **kw):
            self.calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "mask": None if
                               attn_mask is None else (attn_mask.dtype, tuple(attn_mask.shape)),
                               **kw})
            return real(q, k, v, attn_mask=attn_mask, **kw)

        def host(real_fn):
            def read(t, *a):
                self.host_reads += 1
                self.readers.append(sys._getframe(1).f_code.co_filename)
                return real_fn(t, *a)
            return read
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
        monkeypatch.setattr(torch.Tensor, "tolist", host(real_tolist))
        monkeypatch.setattr(torch.Tensor, "item", host(real_item))


def test_uniform_decode_is_one_sdpa_call_with_enable_gqa_and_no_mask(monkeypatch):
    args = paged([1] * 5, [21] * 5, 8, 2, 16, 16, torch.float32, fresh_seed())
    rec = SdpaCalls(monkeypatch)
    BACKENDS["sdpa"].paged(*args)
    assert rec.host_reads == 1, "the lengths come to the host once, for the whole batch"
    [call] = rec.calls
    assert call["mask"] is None and call["enable_gqa"] is True
    assert call["q"] == (5, 8, 1, 16) and call["k"] == (5, 2, 21, 16)
    assert not call.get("is_causal"), "a single query sees all its keys: no causal mask"


def test_decode_with_unequal_lengths_is_one_call_with_a_padding_mask(monkeypatch):
    args = paged([1, 1, 1], [3, 21, 40], 8, 2, 16, 16, torch.float32, fresh_seed())
    rec = SdpaCalls(monkeypatch)
    BACKENDS["sdpa"].paged(*args)
    [call] = rec.calls
    assert call["q"] == (3, 2, 4, 16), "each KV head's 4 query heads are its 4 queries"
    assert call["mask"] == (torch.bool, (3, 1, 1, 40)) and not call.get("enable_gqa")
    assert rec.host_reads == 1


def test_a_mixed_batch_is_one_call_with_one_boolean_mask(monkeypatch):
    args = paged([7, 1, 0, 3], [7, 29, 5, 40], 8, 2, 16, 16, torch.float32, fresh_seed())
    rec = SdpaCalls(monkeypatch)
    BACKENDS["sdpa"].paged(*args, window=6)
    [call] = rec.calls
    assert call["q"] == (4, 8, 7, 16) and call["k"] == (4, 2, 40, 16)
    assert call["mask"] == (torch.bool, (4, 1, 7, 40)) and call["enable_gqa"] is True
    assert rec.host_reads == 1


@pytest.mark.parametrize("name", PEERS)
def test_lengths_given_on_the_host_are_not_read_back_from_the_device(monkeypatch, name):
    lens_q, seq_lens = [3, 1, 1], [3, 21, 40]
    args = paged(lens_q, seq_lens, 8, 2, 16, 16, torch.float32, fresh_seed())
    ref = paged_attention_ref(*args)
    rec = SdpaCalls(monkeypatch)
    outs = [BACKENDS[name].paged(*args, host_lengths=(lens_q, seq_lens))
            for _layer in range(4)]  # the layers of one step, lengths from its host metadata
    labkits = [f for f in rec.readers if "labkit" in pathlib.Path(f).parts]
    assert not labkits, "the engine's step metadata holds the lengths: no layer syncs"
    if name == "sdpa":  # (flex on CPU may trace with Dynamo, which reads scalars of its own)
        assert rec.host_reads == 0
    assert max(max_err(out, ref) for out in outs) < CPU_TOL[torch.float32]


def test_host_lengths_for_another_batch_are_refused():
    args = paged([1, 1], [9, 20], 4, 2, 16, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="host_lengths holds 1 query and 1 key lengths"):
        BACKENDS["sdpa"].paged(*args, host_lengths=([1], [9]))


def test_equal_square_prefill_uses_sdpas_own_causal_flag(monkeypatch):
    args = packed([12, 12], [12, 12], 4, 4, 16, torch.float32, fresh_seed())
    rec = SdpaCalls(monkeypatch)
    BACKENDS["sdpa"].flash(*args)
    [call] = rec.calls
    assert call["mask"] is None and call["is_causal"] is True


# --- flex: one block mask per batch shape, compiled for changing shapes -------------------------

class MaskBuilds:
    def __init__(self, monkeypatch):
        import torch.nn.attention.flex_attention as fa
        self.count, real = 0, fa.create_block_mask

        def build(*a, **kw):
            self.count += 1
            return real(*a, **kw)
        monkeypatch.setattr(fa, "create_block_mask", build)
        monkeypatch.setattr(peers, "_block_masks", type(peers._block_masks)())


def test_flex_builds_one_block_mask_per_batch_shape(monkeypatch):
    builds = MaskBuilds(monkeypatch)
    args = paged([1, 3], [9, 20], 4, 2, 16, 16, torch.float32, fresh_seed())
    for _layer in range(4):  # the layers of one engine step share the step's lengths
        BACKENDS["flex"].paged(*args)
    assert builds.count == 1
    grown = (*args[:5], args[5] + 1)  # the next step: every sequence one token longer
    BACKENDS["flex"].paged(*grown)
    assert builds.count == 2
    BACKENDS["flex"].paged(*args, window=4)
    assert builds.count == 3, "the flags are part of the shape"


def test_a_cached_block_mask_does_not_read_the_callers_buffers(monkeypatch):
    MaskBuilds(monkeypatch)
    q, k, v, table, cu, lens = paged([1, 1], [9, 20], 4, 2, 16, 16, torch.float32, fresh_seed())
    BACKENDS["flex"].paged(q, k, v, table, cu, lens)
    lens.copy_(torch.tensor([20, 9]))  # the caller refills its metadata for the next step
    out = BACKENDS["flex"].paged(q, k, v, table, cu, torch.tensor([9, 20], dtype=torch.int32))
    assert max_err(out, paged_attention_ref(q, k, v, table, cu, torch.tensor([9, 20]))) < 1e-4


def test_flex_mask_cache_is_bounded(monkeypatch):
    builds = MaskBuilds(monkeypatch)
    lq = torch.tensor([1], dtype=torch.int32)
    for n in range(1, peers.FLEX_MASK_CACHE + 6):
        flex_block_mask(PaddedBatch((1,), (n,), True, None), lq, torch.tensor([n]))
    assert len(peers._block_masks) == peers.FLEX_MASK_CACHE
    flex_block_mask(PaddedBatch((1,), (1,), True, None), lq, torch.tensor([1]))
    assert builds.count == peers.FLEX_MASK_CACHE + 6, "the oldest was evicted, rebuilt"


def test_flex_is_compiled_with_dynamic_shapes_on_a_gpu(monkeypatch):
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.update(kw) or fn)
    monkeypatch.setattr(peers, "_compiled_flex", {})
    peers.flex_attention_for(torch.device("cuda"))
    assert seen.get("dynamic") is True, "new lengths must not recompile until Dynamo's limit"


# --- on a GPU: the kernels the calls allow, and no recompiles as lengths change -----------------

@pytest.mark.gpu
def test_uniform_decode_runs_on_sdpas_flash_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    args = paged([1] * 8, [300] * 8, 32, 8, 128, 16, torch.bfloat16, 0, device="cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if the call rules flash out
        out = BACKENDS["sdpa"].paged(*args)
    ref = paged_attention_ref(*args)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
def test_decode_with_padding_runs_on_the_memory_efficient_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    args = paged([1] * 8, [300, 17, 64, 129, 1, 250, 300, 8], 32, 8, 128, 16, torch.bfloat16,
                 0, device="cuda")
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = BACKENDS["sdpa"].paged(*args)
    ref = paged_attention_ref(*args)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
def test_flex_does_not_recompile_as_an_engine_step_grows():
    torch._dynamo.reset()
    peers._compiled_flex.clear()
    frames = torch._dynamo.utils.counters["stats"]
    before = frames["unique_graphs"]
    lens = [40, 300, 129, 7]
    for step in range(12):  # decode steps: every sequence one token longer each step
        args = paged([1] * 4, [n + step for n in lens], 32, 8, 128, 16, torch.bfloat16, step,
                     device="cuda")
        out = BACKENDS["flex"].paged(*args)
        ref = paged_attention_ref(*args)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert frames["unique_graphs"] - before <= 3, "one graph (and a dynamic recompile at most)"
