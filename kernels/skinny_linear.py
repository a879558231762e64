"""Linear layers for a few rows: a decode step streams the weights, so fuse what rides along.

What you will learn: at batch 1 a decode step's matmuls are matrix-vector products. Each weight
byte is read once and used for one multiply-add per row, so the time is the weight's bytes over
the memory bandwidth, and anything else in the step (a norm, an activation, a launch) is time
on top of that floor. ``skinny_linear`` computes ``x @ w.T`` for up to 16 rows, one program per
``BLOCK_N`` output features streaming its slice of ``w``, and folds into the same pass the small
ops a Llama layer runs around its matmuls:

* ``norm_weight=``: the input is ``rms_norm(x + residual) * norm_weight`` (the residual add
  and the RMSNorm that come before the q/k/v and gate/up projections). Every program reads the
  few rows of ``x`` itself (kilobytes from L2, against the megabytes of weight it streams), so no
  program waits on another; program 0 writes the new residual ``x + residual``;
* ``gated=True``: ``w`` holds the gate rows then the up rows (``gate_up_proj``) and the output is
  ``silu(gate) * up``: each program streams its gate slice and the matching up slice.

Two kernels: one row runs ``_gemv_kernel`` (multiply-adds on the CUDA cores; ``gemv=False``
forces the other), 2 to 16 rows ``_skinny_kernel`` (a 16-row ``tl.dot`` tile).
On Hopper the one-row GEMV launches as a programmatic dependent (``pdl``, ``kernels/pdl.py``):
it loads its first chunk of weights, which no kernel writes, before it waits for the kernel
ahead. ``rope=(positions, inv_freq, num_q_heads, num_kv_heads)`` folds RoPE into a one-row q/k/v
GEMV: a program then owns one rotation pair (features i and i + head_dim/2 of a q or k head) and
rotates it before storing, as ``layer_ops.rope_`` would rotate the stored projection.

Rounding follows the eager ops (``add_rms_norm_ref``, ``silu_mul_ref``): the residual sum and the
normed input are rounded to the model's dtype before the matmul reads them, the gate is rounded
before SiLU. ``skinny_linear_ref`` is that eager sequence, and tests compare the two on random
shapes. Past ``MAX_ROWS`` rows a matmul reuses each weight tile across rows and a tiled GEMM
(cuBLAS) is the right kernel: callers switch there.
"""
from __future__ import annotations

import labkit  # noqa: F401  (before triton: interpreter on where there is no GPU)
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from labkit.kernels.grid import cdiv
from labkit.kernels.layer_ops import add_rms_norm_ref, rope_, silu_mul_ref
from labkit.kernels.pdl import launch_options, pdl_for
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MAX_ROWS = 16  # tl.dot's smallest tile: 1 to 16 rows cost the same weight stream


@triton.jit
def _input(X, R, x_offs, r_offs, ok, HAS_RESIDUAL: tl.constexpr):
    """The matmul's input before its norm: ``x``, or ``x + residual`` rounded to the dtype."""
    x = tl.load(X + x_offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + r_offs, mask=ok, other=0.0).to(tl.float32)
             ).to(x.dtype)
    return x


@triton.jit
def _skinny_kernel(X, R, NormW, W, Out, R_out, M, N, K, stride_x, stride_r, stride_w, stride_o,
                   stride_ro, up_offset, eps, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                   GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    dtype = W.dtype.element_ty
    if NORM:
        # First pass over the few input rows: their mean square (and the new residual).
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            ok = row_ok[:, None] & (ks < K)[None, :]
            x = _input(X, R, rows[:, None] * stride_x + ks[None, :],
                       rows[:, None] * stride_r + ks[None, :], ok, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                if pid == 0:
                    tl.store(R_out + rows[:, None] * stride_ro + ks[None, :], x, mask=ok)
            x32 = x.to(tl.float32)
            sq += tl.sum(x32 * x32, 1)
        inv_rms = 1.0 / tl.sqrt(sq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        ok = row_ok[:, None] & k_ok[None, :]
        x = _input(X, R, rows[:, None] * stride_x + ks[None, :],
                   rows[:, None] * stride_r + ks[None, :], ok, HAS_RESIDUAL and NORM)
        if NORM:
            normed = (x.to(tl.float32) * inv_rms[:, None]).to(dtype)
            nw = tl.load(NormW + ks, mask=k_ok, other=0.0)
            x = (normed.to(tl.float32) * nw.to(tl.float32)[None, :]).to(dtype)
        w_ok = col_ok[:, None] & k_ok[None, :]
        w = tl.load(W + cols[:, None] * stride_w + ks[None, :], mask=w_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        if GATED:
            wu = tl.load(W + (cols[:, None] + up_offset) * stride_w + ks[None, :], mask=w_ok,
                         other=0.0)
            acc_up += tl.dot(x, tl.trans(wu), input_precision=PRECISION)
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # F.silu rounds to the dtype here
        out = act.to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    else:
        out = acc
    tl.store(Out + rows[:, None] * stride_o + cols[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _normed(x, NormW, ks, k_ok, inv_rms, NORM: tl.constexpr, dtype: tl.constexpr):
    """A loaded chunk of the row the GEMV multiplies, in float32: ``x`` or its norm."""
    if NORM:
        normed = (x.to(tl.float32) * inv_rms).to(dtype)
        nw = tl.load(NormW + ks, mask=k_ok, other=0.0)
        x = (normed.to(tl.float32) * nw.to(tl.float32)).to(dtype)
    return x.to(tl.float32)[None, :]


@triton.jit
def _gemv_kernel(X, R, NormW, W, Out, R_out, N, K, stride_w, up_offset, eps, Pos, InvFreq,
                 rope_pairs, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_CHUNK: tl.constexpr,
                 PDL: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr):
    # One row: multiply-adds on the CUDA cores, no 16-row tensor-core tile to fill with padding,
    # so a program holds less and more of them fit on each SM.
    pid = tl.program_id(0)
    two = tl.arange(0, BLOCK_N)
    if ROPE:
        # q/k/v with RoPE folded in (BLOCK_N = 2): each of the first ``rope_pairs`` programs owns
        # one rotation pair of a q or k head, features i and i + HALF of head h; the rest take
        # two neighbouring v features.
        pair = tl.minimum(pid, rope_pairs - 1)
        rope_cols = (pair // HALF) * 2 * HALF + pair % HALF + two * HALF
        cols = tl.where(pid < rope_pairs, rope_cols, 2 * rope_pairs + (pid - rope_pairs) * 2 + two)
    else:
        cols = pid * BLOCK_N + two
    col_ok = cols < N
    dtype = W.dtype.element_ty
    # The first chunk of weights is loaded before anything else: no kernel writes them. With
    # PDL (a programmatic dependent launch) this kernel starts while the kernel ahead still
    # runs; it waits for that kernel (which wrote x) only after these loads are issued, then
    # lets the next kernel launch, whose programs take the SMs this one's last programs leave.
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    w_ok = col_ok[:, None] & k_ok[None, :]
    w0 = tl.load(W + cols[:, None] * stride_w + ks[None, :], mask=w_ok, other=0.0)
    if GATED:
        wu0 = tl.load(W + (cols[:, None] + up_offset) * stride_w + ks[None, :], mask=w_ok,
                      other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    # x's first chunk, raw (x + residual where there is one): with ONE_CHUNK (K <= BLOCK_K) it
    # is the whole row, read once for the norm's mean square and for the multiply-adds: after
    # the wait, one round trip to L2 rather than two (the replayed bench_1b step on an H200:
    # 1.02x, 1.02-1.02 over 7 interleaved rounds, against reading it twice).
    x0 = _input(X, R, ks, ks, k_ok, HAS_RESIDUAL and NORM)
    inv_rms = 1.0
    if NORM:
        if ONE_CHUNK:
            if HAS_RESIDUAL:
                if pid == 0:
                    tl.store(R_out + ks, x0, mask=k_ok)
            sq = x0.to(tl.float32) * x0.to(tl.float32)
        else:
            sq = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kc = k0 + tl.arange(0, BLOCK_K)
                ok = kc < K
                x = _input(X, R, kc, kc, ok, HAS_RESIDUAL)
                if HAS_RESIDUAL:
                    if pid == 0:
                        tl.store(R_out + kc, x, mask=ok)
                x32 = x.to(tl.float32)
                sq += x32 * x32
        inv_rms = 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)
    x32 = _normed(x0, NormW, ks, k_ok, inv_rms, NORM, dtype)
    acc = tl.sum(w0.to(tl.float32) * x32, 1)
    if GATED:
        acc_up = tl.sum(wu0.to(tl.float32) * x32, 1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kc = k0 + tl.arange(0, BLOCK_K)
        ok = kc < K
        x32 = _normed(_input(X, R, kc, kc, ok, HAS_RESIDUAL and NORM), NormW, kc, ok, inv_rms,
                      NORM, dtype)
        w_ok = col_ok[:, None] & ok[None, :]
        w = tl.load(W + cols[:, None] * stride_w + kc[None, :], mask=w_ok, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x32, 1)
        if GATED:
            wu = tl.load(W + (cols[:, None] + up_offset) * stride_w + kc[None, :], mask=w_ok,
                         other=0.0)
            acc_up += tl.sum(wu.to(tl.float32) * x32, 1)
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        out = act.to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    else:
        out = acc
    if ROPE:  # rotate the pair as _rope_kernel would the stored projection: rounded first
        r = out.to(dtype).to(tl.float32)
        a = tl.sum(tl.where(two == 0, r, 0.0), 0)
        b = tl.sum(tl.where(two == 1, r, 0.0), 0)
        angle = tl.load(Pos).to(tl.float32) * tl.load(InvFreq + pair % HALF)
        cos = tl.cos(angle).to(dtype).to(tl.float32)
        sin = tl.sin(angle).to(dtype).to(tl.float32)
        rotated = tl.where(two == 0, a * cos - b * sin, b * cos + a * sin)
        out = tl.where(pid < rope_pairs, rotated, r)
    tl.store(Out + cols, out.to(Out.dtype.element_ty), mask=col_ok)


# The tile per shape: DEFAULT[one row?] (LONG_ROWS over it for one row of K >= LONG_K), and
# TUNED[(one row?, N, K, gated)] where a measurement chose one (benchmarks/decode_floor.py
# --linears fills it for its run). One row, raced on an H200 as whole replayed bench_1b steps
# (7 interleaved rounds each, RoPE in the q/k/v GEMV): 2 output features a program, 4 warps, K
# in one step of 2,048 (q/k/v, o, gate_up: the whole row, read once) beat 2 warps in steps of
# 1,024 by 1.035x (1.03-1.04); 8 warps, or 1 or 4 features a program, lost 0.6-6.4%.
# down_proj's K = 8,192 runs one feature a program, 2 warps, K in steps of 2,048 (4 warps lost
# 1.2%; 8 warps in steps of 4,096 0.7%; 4 warps with 2 features or steps of 4,096 0.6-1.5%).
# ``pdl``: launch as a programmatic dependent (Hopper on; see _gemv_kernel): the replayed step
# went from 900 to 849 us (1.062x, 1.060-1.063, 7 interleaved rounds), and to 803 us with the
# layer's other Triton kernels launched so too.
DEFAULT = {True: dict(block_n=2, num_warps=4, num_stages=3, gemv=True, block_k=2048, pdl=True),
           False: dict(block_n=16, num_warps=4, num_stages=3, gemv=False)}
LONG_K, LONG_ROWS = 4096, dict(block_n=1, num_warps=2, block_k=2048)
TUNED: dict[tuple[bool, int, int, bool], dict] = {}


def default_tile(one_row: bool, k: int) -> dict:
    """DEFAULT for this row count, with LONG_ROWS over it for one row of at least LONG_K."""
    return DEFAULT[one_row] | (LONG_ROWS if one_row and k >= LONG_K else {})


def check_rope(rope, n: int, gated: bool, rows: int) -> None:
    """``rope=(positions, inv_freq, num_q_heads, num_kv_heads)`` for a q/k/v weight of ``n``
    rows: a clear error before any launch."""
    if gated or len(rope) != 4:
        raise ValueError("rope=(positions, inv_freq, num_q_heads, num_kv_heads) goes with a q/k/v "
                         "projection, not gated=True")
    positions, inv_freq, hq, hkv = rope
    width = (hq + 2 * hkv) * 2 * inv_freq.numel()
    if n != width:
        raise ValueError(f"rope: a q/k/v weight of (Hq + 2 Hkv) * head_dim = {width} rows for "
                         f"{hq} q heads, {hkv} kv heads and head_dim {2 * inv_freq.numel()}, "
                         f"got {n}")
    if positions.shape != (rows,):
        raise ValueError(f"rope: positions must be [rows={rows}], got {tuple(positions.shape)}")


SHARED_BYTES = 160 * 2**10  # of the 227 KiB an H100/H200 SM has, for the pipelined tiles


def _block_k(k: int, block_n: int, tiles: int, stages: int, elem: int) -> int:
    """The widest K step (at most 512) whose ``stages`` copies of the x tile and the weight
    tiles fit in SHARED_BYTES."""
    block = 16 if k <= 16 else min(512, triton.next_power_of_2(k))
    while block > 16 and stages * (16 + tiles * block_n) * block * elem > SHARED_BYTES:
        block //= 2
    return block


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  gated: bool = False, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  gemv: bool | None = None, block_k: int | None = None,
                  pdl: bool | None = None, rope: tuple | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [M <= 16, K] (rows contiguous); weight: [N, K] (``[2 N, K]`` when ``gated``) ->
    (out [M, N], new residual or None).

    With ``norm_weight`` the input is ``rms_norm(x + residual) * norm_weight`` and the new
    residual (``x + residual``, or ``x`` when ``residual`` is None) comes back too; without it,
    ``out = x @ weight.T`` and ``residual`` must be None. ``gated``: ``silu(gate) * up``.

    The tile (``block_n``, ``num_warps``, ``num_stages``, ``gemv``, ``block_k``) and ``pdl``
    (one row: launch as a programmatic dependent where the GPU has it): each one not given comes
    from ``TUNED`` for this shape (one row or more, N, K, gated), else ``default_tile``.

    ``rope=(positions, inv_freq, num_q_heads, num_kv_heads)``: ``weight`` is a fused q/k/v
    projection and its q and k heads come back rotated, as ``rope_`` would rotate them: for one
    row inside the GEMV (each program then owns one rotation pair), otherwise by ``rope_`` after
    the matmul."""
    if x.dim() != 2 or weight.dim() != 2 or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear wants x [M, K] and weight [N, K] with contiguous rows, "
                         f"got x {tuple(x.shape)} strides {x.stride()}, weight "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    rows, k = x.shape
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    tuned = TUNED.get((rows == 1, n_out, k, gated)) or default_tile(rows == 1, k)
    block_n = tuned["block_n"] if block_n is None else block_n
    num_warps = tuned["num_warps"] if num_warps is None else num_warps
    num_stages = tuned["num_stages"] if num_stages is None else num_stages
    gemv = tuned.get("gemv", False) if gemv is None else gemv
    block_k = tuned.get("block_k") if block_k is None else block_k
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most MAX_ROWS={MAX_ROWS} rows, got x with "
                         f"{rows}: a tiled matmul (F.linear) serves more")
    if weight.shape[1] != k:
        raise ValueError(f"weight [N, K] must have K={k} columns like x, got {tuple(weight.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"gated=True wants weight [2 N, K] (gate rows, then up rows), got "
                         f"{weight.shape[0]} rows")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}: give both one dtype")
    smallest = 1 if rows == 1 and gemv else 16
    if block_n < smallest or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= {smallest} (tl.dot's smallest tile "
                         f"is 16; one row runs without it), got {block_n}")
    if rope is not None:
        check_rope(rope, weight.shape[0], gated, rows)
    if norm_weight is None and residual is not None:
        raise ValueError("residual is added before the norm: pass norm_weight with it")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight must be [K={k}], got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual must match x {tuple(x.shape)} with contiguous rows, got "
                         f"{tuple(residual.shape)} strides {residual.stride()}")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    norm = norm_weight is not None
    new_residual = None
    if norm:
        new_residual = x if residual is None else torch.empty_like(x)
    if rows and not n and residual is not None:  # no program runs to write the residual
        torch.add(x, residual, out=new_residual)
    if rows and n:
        r = residual if residual is not None else x
        ro = new_residual if new_residual is not None else x
        if rows == 1 and gemv:
            pdl = tuned.get("pdl", False) if pdl is None else pdl
            pdl = pdl and pdl_for(x.device)
            positions, inv_freq, heads = (rope[0], rope[1], rope[2] + rope[3]) if rope else \
                (x, x, 0)
            half = inv_freq.numel() if rope else 1
            chunk = min(block_k or 512, max(16, triton.next_power_of_2(k)))
            _gemv_kernel[(cdiv(n, 2) if rope else cdiv(n, block_n),)](
                x, r, norm_weight if norm else x, weight, out, ro, n, k, weight.stride(0), n,
                eps, positions, inv_freq, heads * half, NORM=norm,
                HAS_RESIDUAL=residual is not None, GATED=gated, BLOCK_N=2 if rope else block_n,
                BLOCK_K=chunk, ONE_CHUNK=k <= chunk, PDL=pdl, ROPE=rope is not None, HALF=half,
                num_warps=num_warps, num_stages=num_stages, **launch_options(pdl))
            return out, new_residual
        bk = _block_k(k, block_n, 2 if gated else 1, num_stages, x.element_size())
        _skinny_kernel[(cdiv(n, block_n),)](
            x, r, norm_weight if norm else x, weight, out, ro, rows, n, k, x.stride(0),
            r.stride(0), weight.stride(0), out.stride(0), ro.stride(0), n, eps, NORM=norm,
            HAS_RESIDUAL=residual is not None, GATED=gated, BLOCK_M=16, BLOCK_N=block_n,
            BLOCK_K=min(bk, block_k) if block_k else bk, num_warps=num_warps, num_stages=num_stages,
            # float32 as F.linear computes it (tl.dot would take TF32): the same greedy tokens
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    if rope and rows:  # more than one row (or gemv=False): the matmul, then RoPE's own kernel
        rope_(out, *rope)
    return out, new_residual


def skinny_linear_ref(x, weight, *, residual=None, norm_weight=None, eps=1e-6, gated=False):
    """The eager sequence ``skinny_linear`` fuses: norm, matmul, then SiLU times up."""
    new_residual = None
    if norm_weight is not None:
        x, new_residual = add_rms_norm_ref(x, residual, norm_weight, eps)
    out = F.linear(x, weight)
    return (silu_mul_ref(out) if gated else out), new_residual


if __name__ == "__main__":
    from labkit.device import interpreter_on
    from labkit.measure.bench import gbps, measure

    device = labkit.select_device("auto")
    dtype = torch.float32 if interpreter_on() else torch.bfloat16
    hidden, inter = (64, 96) if interpreter_on() else (2048, 8192)
    g = torch.Generator(device="cpu").manual_seed(0)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for rows in (1, 8):
        x, r = (torch.randn(rows, hidden, generator=g).to(device, dtype) for _ in "xr")
        norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
        gate_up = (torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5).to(device, dtype)
        kw = dict(residual=r, norm_weight=norm_w, eps=1e-5, gated=True)
        got, want = skinny_linear(x, gate_up, **kw), skinny_linear_ref(x, gate_up, **kw)
        torch.testing.assert_close(got[0], want[0], **tol)
        torch.testing.assert_close(got[1], want[1], **tol)
        t = measure(lambda: skinny_linear(x, gate_up, **kw), device=device, repeats=5)
        print(f"{rows} row(s): norm + gate_up + SiLU*up matches the eager sequence; "
              f"{t.median_us:.1f} us, {gbps(gate_up.numel() * gate_up.element_size(), t):.0f} "
              f"GB/s of weight on {device}")
