"""The small ops of a decoder layer, fused: fewer kernels per decode step.

What you will learn: why a decode step replayed from a CUDA Graph can still sit far below the
bandwidth roofline. A graph removes the host's launches, not the kernels: an eager Llama layer
runs about forty of them (two RMSNorms of eight ops each, RoPE on q and k, SiLU, a multiply,
residual adds, casts), each moving a few kilobytes but costing the GPU microseconds. The
matmuls that stream the weights are four of them. This file folds the rest into three kernels:

* ``add_rms_norm``: ``residual = x + residual`` (rounded to the model's dtype, as the eager
  add is) then ``weight * rms_norm(residual)``; the next layer's input norm absorbs this
  layer's last residual add;
* ``rope_``: rotates the q and k heads of the fused qkv output in place, angles computed from
  the positions in float32 (no cos/sin tensors);
* ``silu_mul``: ``silu(gate) * up`` from the fused gate_up output.

Each has a plain torch reference (``*_ref``) beside it, built on ``rms_norm``, ``rope_cos_sin``
and ``apply_rope``: that is the model's plain path itself (``labkit.engine.model`` runs the
references when the fused ops are off), and tests compare each kernel with it on fresh random
shapes.
"""
from __future__ import annotations

import labkit  # noqa: F401  (before triton: interpreter on where there is no GPU)
import torch
import triton
import triton.language as tl
from labkit.kernels.grid import cdiv, next_power_of_2
from labkit.kernels.pdl import launch_options, pdl_for, wait_for_kernel_ahead


@triton.jit
def _add_rms_norm_kernel(X, R, W, Out, R_out, stride_x, stride_r, stride_o, stride_ro, n_cols,
                         eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # The eager add rounds to the model's dtype before the norm reads it: so does this.
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=ok, other=0.0
                                        ).to(tl.float32)).to(R_out.dtype.element_ty)
        tl.store(R_out + row * stride_ro + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    normed = (x32 * inv_rms).to(Out.dtype.element_ty)
    w = tl.load(W + cols, mask=ok, other=0.0)
    tl.store(Out + row * stride_o + cols, (normed.to(tl.float32) * w.to(tl.float32)
                                           ).to(Out.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] (rows contiguous); weight: [H] -> (normed [T, H], new residual).

    With ``residual=None`` the new residual is ``x`` itself (the first layer's input)."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rms_norm wants x [T, H] with contiguous rows and weight [H], got "
                         f"x {tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual must match x {tuple(x.shape)} with contiguous rows, got "
                         f"{tuple(residual.shape)}")
    out = torch.empty_like(x)
    new_residual = x if residual is None else torch.empty_like(x)
    if x.shape[0]:
        r = residual if residual is not None else x
        _add_rms_norm_kernel[(x.shape[0],)](
            x, r, weight, out, new_residual, x.stride(0), r.stride(0), out.stride(0),
            new_residual.stride(0), x.shape[1], eps, HAS_RESIDUAL=residual is not None,
            BLOCK=next_power_of_2(x.shape[1]))
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: [T, H]. The mean square is taken in float32: in bf16 it loses the small components."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(x, residual, weight, eps):
    """``rms_norm(x + residual)`` and the new residual ``x + residual`` (``x`` when None)."""
    r = x if residual is None else x + residual
    return rms_norm(r, weight, eps), r


@triton.jit
def _rope_kernel(QKV, Pos, InvFreq, stride_t, HALF: tl.constexpr, HALF_P: tl.constexpr,
                 PDL: tl.constexpr):
    wait_for_kernel_ahead(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads then k heads: they sit side by side in each qkv row
    i = tl.arange(0, HALF_P)
    ok = i < HALF
    pos = tl.load(Pos + token).to(tl.float32)
    angle = pos * tl.load(InvFreq + i, mask=ok, other=0.0)
    base = QKV + token * stride_t + head * (2 * HALF)
    x1 = tl.load(base + i, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + i, mask=ok, other=0.0)
    # cos and sin rounded to the model's dtype first, as the eager path does
    cos = tl.cos(angle).to(x1.dtype).to(tl.float32)
    sin = tl.sin(angle).to(x1.dtype).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base + i, (a * cos - b * sin).to(x1.dtype), mask=ok)
    tl.store(base + HALF + i, (b * cos + a * sin).to(x1.dtype), mask=ok)


def rope_(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
          num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) * D] (the fused projection's output, rows contiguous); rotates
    its q and k heads in place (the half-split pairing: i with i + D/2) and returns it."""
    head_dim = 2 * inv_freq.numel()
    if qkv.dim() != 2 or qkv.stride(1) != 1 or \
            qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"rope_ wants qkv [T, (Hq + 2 Hkv) * D] = [T, "
                         f"{(num_q_heads + 2 * num_kv_heads) * head_dim}] with contiguous rows, "
                         f"got {tuple(qkv.shape)} strides {qkv.stride()}")
    if positions.shape != (qkv.shape[0],):
        raise ValueError(f"positions must be [T={qkv.shape[0]}], got {tuple(positions.shape)}")
    if qkv.shape[0]:
        half = head_dim // 2
        _rope_kernel[(qkv.shape[0], num_q_heads + num_kv_heads)](
            qkv, positions, inv_freq, qkv.stride(0), HALF=half, HALF_P=next_power_of_2(half),
            PDL=(pdl := pdl_for(qkv.device)), **launch_options(pdl))
    return qkv


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """positions: [T] -> cos, sin: [T, head_dim], float32 (angles lose precision in bf16)."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)  # dimension i pairs with i + head_dim/2
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] rotated by its token's angles; cos, sin: [T, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + rotated * sin


def rope_ref(qkv, positions, inv_freq, num_q_heads, num_kv_heads):
    """``apply_rope`` on the q and k parts of a copy of ``qkv``."""
    head_dim = 2 * inv_freq.numel()
    cos, sin = rope_cos_sin(positions, inv_freq)
    out = qkv.clone()
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q = out[:, :q_size].view(-1, num_q_heads, head_dim)
    k = out[:, q_size:q_size + kv_size].view(-1, num_kv_heads, head_dim)
    out[:, :q_size] = apply_rope(q, cos, sin).reshape(-1, q_size)
    out[:, q_size:q_size + kv_size] = apply_rope(k, cos, sin).reshape(-1, kv_size)
    return out


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(GU + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + n_cols + cols, mask=ok, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # F.silu rounds to the dtype here
    tl.store(Out + row * stride_o + cols, (act.to(tl.float32) * up.to(tl.float32)
                                           ).to(Out.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 I] (gate, then up) -> silu(gate) * up: [T, I]."""
    if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul wants gate_up [T, 2 I] with contiguous rows, got "
                         f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    n = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0] and n:
        block = min(1024, next_power_of_2(n))
        _silu_mul_kernel[(gate_up.shape[0], cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out


def silu_mul_ref(gate_up):
    """gate_up: [T, 2 I] -> ``silu(gate) * up``: [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


if __name__ == "__main__":
    from labkit.device import interpreter_on
    from labkit.measure.bench import gbps, measure

    device = labkit.select_device("auto")
    dtype = torch.float32 if interpreter_on() else torch.bfloat16
    tokens, hidden, heads, kv_heads, head_dim, inter = (
        (7, 256, 4, 2, 64, 512) if interpreter_on() else (64, 2048, 32, 8, 64, 8192))
    g = torch.Generator(device="cpu").manual_seed(0)
    x, r = (torch.randn(tokens, hidden, generator=g).to(device, dtype) for _ in "xr")
    w = torch.randn(hidden, generator=g).to(device, dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(device, dtype)
    positions = torch.arange(100, 100 + tokens, device=device)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    gate_up = torch.randn(tokens, 2 * inter, generator=g).to(device, dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(add_rms_norm(x, r, w, 1e-6), add_rms_norm_ref(x, r, w, 1e-6)):
        torch.testing.assert_close(got, want, **tol)  # the normed rows and the new residual
    torch.testing.assert_close(rope_(qkv.clone(), positions, inv_freq, heads, kv_heads),
                               rope_ref(qkv, positions, inv_freq, heads, kv_heads), **tol)
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_ref(gate_up), **tol)
    print(f"add_rms_norm, rope_ and silu_mul match their references ({dtype}, {device})")
    if interpreter_on():
        print("(Triton's interpreter runs the kernels in Python: their times say nothing of a GPU)")
    cases = {"add_rms_norm": ((lambda: add_rms_norm(x, r, w, 1e-6)),
                              (lambda: add_rms_norm_ref(x, r, w, 1e-6)), 4 * x.numel()),
             "silu_mul": ((lambda: silu_mul(gate_up)), (lambda: silu_mul_ref(gate_up)),
                          3 * gate_up.numel() // 2)}
    for name, (fused, plain, elements) in cases.items():
        for label, fn in (("triton", fused), ("torch ", plain)):
            t = measure(fn, device=device, warmup=2, repeats=5 if interpreter_on() else 50)
            print(f"{name:12s} {label} {t}  {gbps(elements * x.element_size(), t):8.2f} GB/s")
