"""Read the machine code a GPU would run, on any machine: labkit's paged decode loop compiled
ahead of time for Hopper (sm_90) and its instructions counted.

Triton's wheel carries NVIDIA's assembler (ptxas) and disassembler (cuobjdump), so the whole
path from the Python kernel to SASS, the GPU's own instruction set, runs without a GPU. The
compile uses the tile plan ``paged_attention`` would pick (``kernels.paged_attention_tiles``)
and the specialisation a launch would get (pointers and strides divisible by 16), so the loop
counted here is the loop an H200 runs.

Used by notebook 06 to show why an fp8 cache does not double decode speed: per key, the fp8
loop issues about as many instructions as the bf16 one, and some of them are byte-wide
shared-memory loads that transpose V for the tensor cores.

The compile runs in a child process: in a process where Triton's interpreter is on (every
CPU-only labkit process), Triton's code generator cannot run.
"""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

POINTERS = {"Q": "*bf16", "block_tables": "*i32", "cu_seqlens_q": "*i32", "seq_lens": "*i32",
            "k_scale": "*fp32", "v_scale": "*fp32", "Out": "*bf16", "Lse": "*bf16"}
CACHE_TYPES = {"bf16": ("*bf16", 2), "fp8_e4m3": ("*fp8e4nv", 1)}
GROUPS = [  # how notebook 06 groups the opcodes (first match wins)
    ("fp8 -> f16 conversions", r"^F2FP\.F16\.E4M3"),
    ("tensor-core MMAs", r"^HMMA"),
    ("byte loads from shared memory", r"^LDS\.U8"),
    ("other shared-memory traffic", r"^(LDS|LDSM|STS|STSM)"),
    ("global loads and copies", r"^(LDG|LDGSTS|LDGDEPBAR|DEPBAR)"),
    ("float arithmetic", r"^(FADD|FMUL|FFMA|FMNMX|FSEL|MUFU|HMUL2|HADD2|HFMA2|F2FP)"),
    ("integer, address and moves", (r"^(IMAD|IADD3|SHF|LEA|LOP3|SEL|ISETP|VIADD|MOV|PRMT|SGXT|"
                                   r"IABS|UIADD3|UISETP|USEL|ULEA|UMOV|PLOP3|P2R|R2P)")),
    ("barriers and branches", r"^(BAR|BRA|BSSY|BSYNC|WARPSYNC|SHFL)"),
]


def _tools() -> Path:
    from triton.backends import nvidia
    folder = Path(nvidia.__file__).parent / "bin"
    if not (folder / "cuobjdump").exists():
        raise RuntimeError(f"no cuobjdump in {folder}: this Triton wheel does not carry NVIDIA's "
                           "binary tools, so SASS cannot be read here")
    return folder


def _compile(cache: str, head_dim: int, group: int, block_size: int, arch: int) -> dict:
    """In a process with the interpreter off: compile, disassemble, count the main loop."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from labkit.kernels.paged_attention import paged_attention_kernel as kernel
    from labkit.kernels.paged_attention_tiles import tile_plan

    fp8 = cache == "fp8_e4m3"
    consts, launch = tile_plan(fp8, head_dim, group, max_query_len=1, causal=True)
    consts.update(HEAD_DIM=head_dim, BLOCK_SIZE=block_size, WINDOW=False, SPLIT=False,
                  num_splits=1)  # a launch specialises an int argument equal to 1
    names = kernel.arg_names
    kv_type, kv_bytes = CACHE_TYPES[cache]
    signature = {n: "i32" for n in names}
    signature.update(POINTERS, K_cache=kv_type, V_cache=kv_type, qk_scale="fp32",
                     sm_scale="fp32", **{k: "constexpr" for k in consts})
    aligned = [n for n in names if signature[n].startswith("*") or n.startswith("stride_")]
    source = ASTSource(kernel, signature,
                       constexprs={(names.index(k),): v for k, v in consts.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={k: v for k, v in launch.items() if k != "maxnreg"})
    tools = _tools()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([tools / "cuobjdump", "--dump-sass", cubin], check=True,
                              capture_output=True, text=True).stdout
        usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", cubin],
                               check=True, capture_output=True, text=True).stdout
    body = main_loop(sass)
    warps, block_n = launch["num_warps"], consts["BLOCK_N"]
    return {"cache": cache, "arch": f"sm_{arch}", "head_dim": head_dim, "group": group,
            "block_n": block_n, "num_warps": warps, "num_stages": launch["num_stages"],
            "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "instructions_per_warp": len(body),
            "instructions_per_key": len(body) * warps / block_n,
            "kv_bytes_per_key": 2 * head_dim * kv_bytes,
            "opcodes": dict(collections.Counter(body).most_common())}


_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def main_loop(sass: str) -> list[str]:
    """Opcodes of the largest loop in a SASS listing: the body between a backward branch and
    its target, one entry per instruction (with its modifiers, e.g. ``LDS.U8``)."""
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_LINE.match,
                                                                      sass.splitlines()) if m]
    best: list[str] = []
    for address, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < address:
            body = [o for a, o, _ in code if int(target.group(1), 16) <= a <= address]
            best = max(best, body, key=len)
    if not best:
        raise ValueError("no loop (backward branch) found in this SASS")
    return best


def decode_loops(head_dim: int = 128, group: int = 4, block_size: int = 16,
                 arch: int = 90) -> dict[str, dict]:
    """The paged decode loop for a bf16 and an fp8 cache (decode of GQA 32/8, head_dim 128 by
    default), compiled for ``sm_{arch}`` in a child process; ~20 s on a laptop-class CPU."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    args = [sys.executable, "-m", "labkit.lessons.attention_backends.sass", str(head_dim), str(group),
            str(block_size), str(arch)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode:
        raise RuntimeError(f"compiling the decode loop for sm_{arch} failed:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def group_opcodes(opcodes: dict[str, int]) -> dict[str, int]:
    """Counts per group of ``GROUPS`` (anything else under "other")."""
    out = collections.Counter()
    for op, n in opcodes.items():
        out[next((name for name, pattern in GROUPS if re.match(pattern, op)), "other")] += n
    return {name: out[name] for name, _ in [*GROUPS, ("other", "")] if out[name]}


def loop_table(loops: dict[str, dict]) -> pd.DataFrame:
    """One column per cache dtype: the loop's shape, its instructions per key and per KV byte,
    and its instructions by group, per warp and per iteration."""
    rows = {}
    for cache, d in loops.items():
        rows[cache] = {"warps x BLOCK_N keys": f"{d['num_warps']} x {d['block_n']}",
                       "registers per thread": d["registers"],
                       "instructions per warp per iteration": d["instructions_per_warp"],
                       "instructions per key (all warps)": round(d["instructions_per_key"], 1),
                       "instructions per KB of KV": round(
                           1024 * d["instructions_per_key"] / d["kv_bytes_per_key"], 1),
                       **group_opcodes(d["opcodes"])}
    return pd.DataFrame(rows).fillna(0)


if __name__ == "__main__":  # the child process of decode_loops
    head_dim, group, block_size, arch = map(int, sys.argv[1:5])
    result = {cache: _compile(cache, head_dim, group, block_size, arch) for cache in CACHE_TYPES}
    print(json.dumps(result))
