"""FlashAttention-style forward over a packed variable-length batch, in Triton.

What you will learn: why attention need not write its [len_q, len_k] score matrix to memory.
Each program owns one tile of BLOCK_M queries of one head. That tile stays in SRAM/registers
for the whole run, while tiles of BLOCK_N keys and values stream past it from HBM. An online
softmax keeps a running row maximum ``m`` and row sum ``l`` so earlier partial results can be
rescaled when a larger score turns up; the output is divided by ``l`` once, at the end.

HBM traffic per program: Q tile once (BLOCK_M*D), every visible K and V tile once
(2*BLOCK_N*D per tile), the output once. FLOPs per tile: 2 matmuls of 2*BLOCK_M*BLOCK_N*D.

Masking (see ``labkit.attention.reference``): query i of a sequence sits at position
``len_k - len_q + i``; causal keeps keys at or before it, ``window`` keeps the W most recent.
Key tiles that are entirely visible skip the mask arithmetic; only tiles on the diagonal or the
window's edge pay for it.

Two ways to bring a tile in (``TMA``). With pointers, every thread computes the addresses of
its share of the tile and the compiler turns the loads into asynchronous copies. On Hopper and
later, a tensor descriptor names the tensor's shape and strides once, and one instruction asks
the Tensor Memory Accelerator (TMA), the SM's unit for bulk tensor copies, for a whole
[BLOCK_N, D] tile by its coordinates: no address arithmetic in the loop, rows past the tensor's
end come back as zeros, and the tile lands in shared memory laid out for the tensor cores. The
H200 recording (causal B4 H32 S4096 D128 bf16) times both: ``prefill``, "ours, pointer loads"
against "triton (ours)", in labkit/recorded_data/attention_backends.json.
"""
from __future__ import annotations

import math

import labkit  # noqa: F401  (before triton: interpreter on where there is no GPU)
import torch
import triton
import triton.language as tl
from labkit.device import interpreter_on
from labkit.kernels.attention_checks import (check_cu_seqlens, check_flag,
                                             check_heads_and_dtypes, check_window,
                                             resolve_max_query_len, softmax_scale)

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton: pointers only
    TensorDescriptor = None


def _set_tile_shapes(args):
    """A descriptor is told its tile's shape at launch, once the autotuner has picked the
    tiles; with pointers there is nothing to set."""
    if isinstance(args["Kd"], TensorDescriptor):
        args["Qd"].block_shape = [args["BLOCK_M"], args["HEAD_DIM"]]
        args["Kd"].block_shape = args["Vd"].block_shape = [args["BLOCK_N"], args["HEAD_DIM"]]


def _configs():
    def config(m, n, warps, stages=1):
        return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages,
                             pre_hook=_set_tile_shapes)
    if interpreter_on():  # small tiles: many tiles per sequence even at the tests' small sizes
        return [config(16, 16, 4)]
    return [  # a short list: every distinct key below compiles each of these once
        config(128, 128, 8, 3),  # the H200's best with descriptors (224 KB of shared memory)
        config(128, 64, 8, 3),
        config(128, 128, 8, 2),
        config(128, 64, 4, 3),
        config(64, 64, 4, 3),
        config(64, 32, 4, 2),
    ]


def fits_in_shared_memory(configs, named_args, **kwargs):
    """The Q tile and a K and a V tile per pipeline stage, at the inputs' element size, must fit
    in the 227 KB of shared memory a Hopper block may have. A config the GPU would refuse is
    dropped before it is compiled: float32 tiles are twice bf16's, and compiling configs only
    to have them refused costs seconds each."""
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM", 128))
    q = named_args.get("Q")
    element = q.element_size() if hasattr(q, "element_size") else 2
    fits = [c for c in configs if element * head_dim * (
        c.kwargs["BLOCK_M"] + 2 * c.kwargs["BLOCK_N"] * max(c.num_stages, 1)) <= 227 * 1024]
    return fits or configs[-1:]


@triton.jit
def attend_range(acc, l_i, m_i, q, K, V, Kd, Vd, kv_col, k_row0, stride_kt, stride_vt, start,
                 end, len_k, pos, qk_scale, window, offs_n, offs_d,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                 WINDOW: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr):
    """Fold key tiles [start, end) into the running (acc, l, m) of one query tile."""
    for n in range(start, end, BLOCK_N):
        keys = n + offs_n
        in_seq = keys < len_k
        if TMA:  # one TMA request per tile: rows [k_row0 + n, + BLOCK_N) of this head
            k = tl.trans(Kd.load([(k_row0 + n).to(tl.int32), kv_col]))  # [D, BLOCK_N]
            v = Vd.load([(k_row0 + n).to(tl.int32), kv_col])  # [BLOCK_N, D]
            if MASKED:  # rows past this sequence belong to the next one: zero them, as below
                v = tl.where(in_seq[:, None], v, 0.0)
        else:
            k_ptrs = K + (k_row0 + keys)[None, :] * stride_kt + offs_d[:, None]  # [D, BLOCK_N]
            v_ptrs = V + (k_row0 + keys)[:, None] * stride_vt + offs_d[None, :]  # [BLOCK_N, D]
            if MASKED:
                k = tl.load(k_ptrs, mask=in_seq[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
        s = tl.dot(q, k, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        if MASKED:
            ok = in_seq[None, :]
            if CAUSAL:
                ok = ok & (keys[None, :] <= pos[:, None])
            if WINDOW:
                ok = ok & (keys[None, :] > pos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
        # Scores scaled by qk_scale = scale * log2(e): exp2 is the GPU's native exponential, and
        # s * qk_scale - m is one fused multiply-add.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was summed under the old maximum
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_configs(), key=["HEAD_DIM", "GROUP", "CAUSAL", "WINDOW", "TMA"],
                 prune_configs_by={"early_config_prune": fits_in_shared_memory})
@triton.jit
def flash_fwd_kernel(Q, K, V, Qd, Kd, Vd, Out, cu_seqlens_q, cu_seqlens_k,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ot, stride_oh, qk_scale, window,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                     WINDOW: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Causal tiles at the end of a sequence have the most keys: start them first.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_row0 = tl.load(cu_seqlens_q + seq).to(tl.int64)
    len_q = (tl.load(cu_seqlens_q + seq + 1) - q_row0).to(tl.int32)
    k_row0 = tl.load(cu_seqlens_k + seq).to(tl.int64)
    len_k = (tl.load(cu_seqlens_k + seq + 1) - k_row0).to(tl.int32)
    m0 = tile * BLOCK_M
    if m0 >= len_q:
        return
    kv_head = head // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    pos = len_k - len_q + offs_m  # each query's position among the keys (end-aligned)

    if TMA:  # rows past this sequence are other queries: computed, never stored
        q = Qd.load([(q_row0 + m0).to(tl.int32), head * HEAD_DIM])
    else:
        q_ptrs = Q + (q_row0 + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=(offs_m < len_q)[:, None], other=0.0)
    K += kv_head * stride_kh
    V += kv_head * stride_vh

    # Keys this tile can see at all: [lo, hi). Inside [full_lo, full_hi) every query sees every
    # key, so those tiles skip the mask. Clamped at 0 so integer division never meets negatives.
    pos_first = len_k - len_q + m0
    pos_last = pos_first + BLOCK_M - 1
    hi = len_k
    full_hi = len_k
    if CAUSAL:
        hi = tl.maximum(tl.minimum(len_k, pos_last + 1), 0)
        full_hi = tl.maximum(tl.minimum(len_k, pos_first + 1), 0)
    lo = 0
    full_lo = 0
    if WINDOW:
        lo = tl.maximum(pos_first - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.maximum(pos_last - window + 1, 0)
    full_lo = tl.minimum((full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N, hi)
    full_hi = tl.maximum(full_hi // BLOCK_N * BLOCK_N, full_lo)

    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: a fully masked tile gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_col = kv_head * HEAD_DIM  # this head's columns in a descriptor's [tokens, heads * D]
    acc, l_i, m_i = attend_range(acc, l_i, m_i, q, K, V, Kd, Vd, kv_col, k_row0, stride_kt,
                                 stride_vt, lo, full_lo, len_k, pos, qk_scale, window, offs_n,
                                 offs_d, BLOCK_N, True, CAUSAL, WINDOW, TMA, PRECISION)
    acc, l_i, m_i = attend_range(acc, l_i, m_i, q, K, V, Kd, Vd, kv_col, k_row0, stride_kt,
                                 stride_vt, full_lo, full_hi, len_k, pos, qk_scale, window,
                                 offs_n, offs_d, BLOCK_N, False, CAUSAL, WINDOW, TMA, PRECISION)
    acc, l_i, m_i = attend_range(acc, l_i, m_i, q, K, V, Kd, Vd, kv_col, k_row0, stride_kt,
                                 stride_vt, full_hi, hi, len_k, pos, qk_scale, window, offs_n,
                                 offs_d, BLOCK_N, True, CAUSAL, WINDOW, TMA, PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a query that saw no key gives zeros
    o_ptrs = Out + (q_row0 + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < len_q)[:, None])


# ---------------------------------------------------------------------------------------------
# Host side: the input checks (attention_checks.py), the tensor descriptors, then the launch.

def _descriptor(t: torch.Tensor):
    """``t`` [tokens, heads, D] seen as [tokens, heads * D] by the TMA, or None where a
    descriptor cannot address it: heads not packed side by side, or the 16-byte alignment TMA
    needs of the base and the row stride broken (a slice of a larger tensor can do either)."""
    tokens, heads, head_dim = t.shape
    if t.stride(1) != head_dim or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    return TensorDescriptor(t, [tokens, heads * head_dim], [t.stride(0), 1],
                            [16, head_dim])  # the real tile shape is set at launch


def _tma_available(device: torch.device) -> bool:
    """TMA descriptors: Hopper (compute capability 9.0) and later, and the
    interpreter (which emulates them, so the CPU tests read this path too)."""
    if TensorDescriptor is None:
        return False
    if interpreter_on():
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def flash_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool = True,
                    window: int | None = None, scale: float | None = None,
                    max_seqlen_q: int | None = None, check: bool = True,
                    tma: bool | None = None) -> torch.Tensor:
    """q: [total_q, Hq, D]; k, v: [total_k, Hkv, D]; cu_seqlens_*: int32 [batch + 1]
    -> out: [total_q, Hq, D], q's dtype.

    ``check=False`` skips the checks that read cu_seqlens (a host sync each); with
    ``max_seqlen_q`` given as well, the call never waits for the GPU (CUDA Graph capture needs it).
    ``tma``: load tiles through tensor descriptors (True), through pointers (False), or the
    descriptors wherever the GPU and the tensors' layout allow them (None).
    float32 inputs take IEEE float32 dots, as torch's float32 matmuls do, not TF32: slower,
    but float32 is where labkit compares results token for token.
    """
    check_heads_and_dtypes(q, k, v, k_dims=3)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k and v must have q's dtype {q.dtype}, got k {k.dtype} and v "
                        f"{v.dtype}; convert them with .to(q.dtype)")
    check_window(causal, window)
    check_flag("tma", tma, allow_none=True)
    longest_q = check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q", q.device, check)
    check_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k", q.device, check)
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k describe different batch sizes "
                         f"({cu_seqlens_q.numel() - 1} vs {cu_seqlens_k.numel() - 1})")
    max_seqlen_q = resolve_max_query_len(max_seqlen_q, longest_q, cu_seqlens_q, q.shape[0],
                                         "max_seqlen_q", "queries")
    out = torch.empty_like(q)
    batch, num_q_heads, head_dim = cu_seqlens_q.numel() - 1, q.shape[1], q.shape[2]
    if max_seqlen_q == 0 or q.shape[0] == 0:
        return out
    scale = softmax_scale(scale, head_dim)
    descriptors = [None] * 3
    if tma is not False and _tma_available(q.device) and k.shape[0] > 0:
        descriptors = [_descriptor(t) for t in (q, k, v)]
    use_tma = all(d is not None for d in descriptors)
    if tma and not use_tma:
        raise ValueError("tma=True needs Triton's tensor descriptors on a GPU of compute "
                         "capability 9.0 or later, and q, k, v whose heads are packed "
                         "(stride(1) == head_dim) with 16-byte aligned rows; pass tma=None to "
                         "fall back to pointer loads")
    if not use_tma:  # the pointer path never reads these arguments
        descriptors = [q, k, v]

    def grid(meta):
        return (triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), num_q_heads, batch)

    flash_fwd_kernel[grid](
        q, k, v, *descriptors, out, cu_seqlens_q, cu_seqlens_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), scale * math.log2(math.e), window or 0,
        GROUP=num_q_heads // k.shape[1], HEAD_DIM=head_dim, CAUSAL=bool(causal),
        WINDOW=window is not None, TMA=use_tma,
        # tl.dot's default takes float32 as TF32 (10-bit mantissas, ~1e-3 off): enough to flip a
        # greedy token. 16-bit inputs ignore the setting.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


if __name__ == "__main__":
    from labkit.attention.reference import flash_attention_ref
    from labkit.measure.bench import measure, tflops

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    lens = [37, 1, 0, 70]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    q = torch.randn(sum(lens), 8, 64, device=dev, dtype=dtype)
    k, v = (torch.randn(sum(lens), 2, 64, device=dev, dtype=dtype) for _ in range(2))
    for window in (None, 16):
        err = (flash_attention(q, k, v, cu, cu, window=window).double()
               - flash_attention_ref(q, k, v, cu, cu, window=window)).abs().max().item()
        print(f"lengths {lens}, GQA 8/2, window {window}: max abs error vs float64 {err:.2e}")
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), "flash_attention is wrong"
    if dev == "cuda":
        B, H, S, D = 4, 32, 4096, 128
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=dev)
        q, k, v = (torch.randn(B * S, H, D, device=dev, dtype=dtype) for _ in range(3))
        t = measure(lambda: flash_attention(q, k, v, cu, cu, max_seqlen_q=S, check=False),
                    device=dev)
        print(f"causal B{B} H{H} S{S} D{D}: {t}, {tflops(2 * B * H * S * S * D, t):.0f} TFLOP/s")
