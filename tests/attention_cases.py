"""Inputs shared by the attention kernel tests: packed and paged batches from a seed, and the
error measures they are judged by."""
import math
import os

import torch

CPU_TOL = {torch.float32: 2e-4, torch.float16: 3e-3}
FP8 = torch.float8_e4m3fn


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def cu_seqlens(lens, device="cpu"):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def packed(lens_q, lens_k, hq, hkv, d, dtype, seed, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(device, dtype)
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=g).to(device, dtype) for _ in range(2))
    return q, k, v, cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)


def paged(lens_q, seq_lens, hq, hkv, d, block_size, dtype, seed, device="cpu", spare_blocks=1):
    """A paged batch whose blocks are scattered through the cache, as after real allocation."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = max(math.ceil(n / block_size) for n in seq_lens) + spare_blocks
    num_blocks = len(seq_lens) * width + 3
    table = torch.randperm(num_blocks, generator=g)[: len(seq_lens) * width]
    table = table.reshape(len(seq_lens), width).int().to(device)
    shape = (num_blocks, block_size, hkv, d)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(2))
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(device, dtype)
    return (q, k_cache, v_cache, table, cu_seqlens(lens_q, device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device))


def max_err(out, ref):
    assert out.shape == ref.shape, f"output shape {tuple(out.shape)} != {tuple(ref.shape)}"
    return (out.double() - ref.double()).abs().amax().item() if out.numel() else 0.0


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def captured(step):
    """(a CUDA Graph of ``step()``, what the captured call returned): warmed up on a side
    stream first (compiles, allocations), as capture needs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
