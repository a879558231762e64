"""Notebook 00: this machine's fingerprint, the map of the sequence and of the chapter's
concepts, and the two ceilings every later figure is read against, beside the datasheet."""
from __future__ import annotations

import pandas as pd
import torch

from labkit.device import fingerprint
from labkit.teaching import claim
from labkit.tools import NOTEBOOK_DIR

# Vendors' datasheet figures (not measured): NVIDIA's H200 SXM and H100 SXM datasheets give HBM
# bandwidth and dense (no sparsity) BF16 tensor-core throughput.
DATASHEETS = {
    "NVIDIA H200": {"copy_GBps": 4800.0, "matmul_TFLOPs": 989.0,
                    "source": "NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, 989 TFLOP/s dense BF16"},
    "NVIDIA H100 80GB HBM3": {"copy_GBps": 3350.0, "matmul_TFLOPs": 989.0,
                              "source": "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOP/s "
                                        "dense BF16"},
}

# The chapter's concepts (shared/COVERAGE.md): where each is shown ("NN §k": section k of
# notebook NN; "§Name": the section whose heading holds Name; "NN.k": exercise NN.k), and
# whether what it measures needs a GPU (False: it runs live on a CPU too). No place: not yet.
CONCEPTS = [
    ("An attention backend is paged addressing plus IO tiling, matched to dtype, mask, layout",
     ("06 §1", "06.1", "06.2"), False),
    ("What to check before choosing a backend: model, cache, request, graph, hardware",
     ("06 §3",), False),
    ("Automatic backend selection with its log; forcing one only where it is supported",
     ("06 §3", "08 §1"), False),
    ("Eager mode as a diagnostic control", ("02 §Eager mode", "08 §1"), False),
    ("Piecewise vs full-graph capture; compile enabled is not everything fused",
     ("03 §3", "03 §6"), True),
    ("The controlled experiment: backends x eager/graph, first-run and steady-state costs",
     ("08 §1",), True),
    ("Lower launch cost eaten by padding arithmetic", ("02 §3", "08 §3", "08a §3"), True),
    ("Stream/event ordering of batch metadata copies", ("04 §3", "04.1", "08 §2", "08.1"), True),
    ("Streams have no natural order: reusing a copy's source too early", ("04 §4", "04.2"), True),
    ("CUDA Graph capture and replay: warm-up, static buffers, fixed addresses",
     ("02 §1", "02.1"), True),
    ("The static_in = next_batch pitfall vs static_in.copy_(next_batch)", ("02 §2", "01.1"), False),
    ("Graph costs: capture time, memory, one graph per bucket", ("02 §3", "02.2"), True),
    ("Graphs help decode (many short kernels), not long prefill; short prefill chunks and "
     "mixed steps replay piecewise", ("01 §3", "07 §3", "07 §4"), True),
    ("Reading the profiler: CPU gaps before small kernels", ("01 §1", "07a §1"), True),
    ("Graphs vs kernels chosen by context length: (batch, context) buckets",
     ("02 §2", "02 §3"), True),
    ("torch.compile: Dynamo -> FX -> AOTAutograd -> Inductor -> Triton/C++", ("03 §1",), False),
    ("Compile modes and dynamic=False recompiles", ("03 §4", "03 §5"), False),
    ("Graph breaks from data-dependent control flow; the torch.where fix", ("03 §2", "03.1"),
     False),
    ("dynamic=True vs shape buckets", ("03 §4",), False),
    ("Compile pitfalls: breaks, recompiles, cold start, guards", ("03 §2", "03 §5"), False),
    ("Overlap: CPU with GPU, copies with compute, communication with compute",
     ("04 §3", "04 §5", "07 §4", "09 §2"), True),
    ("Pinned vs pageable memory", ("04 §1",), True),
    ("Paging, continuous batching and prefix caching", ("05 §1", "05 §3", "05.2", "08 §1"), False),
    ("MLA: one shared latent per token, weight absorption",
     ("05 §1", "06 §3", "10 §1", "10 §2", "10 §5"), False),
    ("Speculative verification: several new tokens checked in one forward",
     ("11 §1", "11 §2", "11 §3", "11 §4"), False),
    ("Piecewise vs full CUDA graphs inside the engine", ("03 §3", "07 §4", "08 §1"), True),
]

# (stem, what the learner sees, what needs a GPU, what the CPU shows instead)
SEQUENCE = [
    ("00_tour", "this machine, the map, a first live measurement", "-", "everything runs live"),
    ("01_launch_overhead", "CPU launch gaps on the timeline; CUDA Graph replay removes them",
     "graph replay, GPU timeline", "Python dispatch vs torch.compile, recorded GPU sweep"),
    ("02_cuda_graphs", "capture/replay, static buffers, copy_ vs rebinding, bucket pool",
     "graph replay, capture errors", "the same pitfalls live via a stand-in, recorded GPU figures"),
    ("03_torch_compile", "Dynamo -> FX -> Inductor, graph breaks, guards, recompiles, modes",
     "reduce-overhead mode", "Inductor's C++ path, live"),
    ("03a_compile_in_the_engine", "the engine's model as plain ops, hand-fused Triton and "
     "Inductor: kernel census, replayed step, compile cost", "replayed step, compile",
     "recorded H200 table"),
    ("04_pinned_memory_streams", "pageable vs pinned H2D, streams, events, overlap",
     "streams, pinned DMA", "recorded figures, synchronous API"),
    ("05_paged_kv_cache", "block tables, fragmentation, MHA/GQA/MLA bytes, fp8 scales, prefix "
     "caching and the TTFT it saves, eviction, copy-on-write",
     "-", "everything runs live"),
    ("06_attention_backends", "IO tiling, paged decode in Triton, backend selection, roofline",
     "kernel speed", "Triton interpreter for correctness, recorded speeds"),
    ("06a_attention_deep_dives", "TMA loads, L2 reuse, registry vs bare kernel, fp8 SASS and "
     "accuracy, block sizes", "kernel speed",
     "sm_90 SASS compiled here, fp8 accuracy live, recorded H200 speeds"),
    ("07_prefill_vs_decode", "compute- vs memory-bound, TTFT/TPOT, chunked prefill",
     "roofline points", "tiny model live, recorded GPU points"),
    ("07a_prefill_decode_deep_dives", "eager step = max(host floor, GPU), kernel census, fused "
     "small ops, context growth, chunked steps vs host", "live bounds, kernel census, fused gain",
     "CPU op census and context growth live, recorded GPU bounds"),
    ("08_putting_it_together", "continuous batching engine; backend x eager/graph experiment",
     "graphs, speed", "tiny model live, recorded GPU table"),
    ("08a_padding_and_buckets", "padding per bucket set step by step, vLLM sizes, planned "
     "buckets, priced in step time", "graph step times", "counts live, recorded H200 step times"),
    ("09_multi_gpu_overlap", "tensor-parallel layer: all-reduce overlapped with compute",
     "two GPUs, NCCL", "2-process gloo on CPU, recorded 2-GPU timeline"),
    ("10_mla", "MLA's cache bytes, weight absorption, the latent-cache kernel on the roofline, "
     "the engine serving a DeepSeek-shaped model", "decode speed, graphed engine",
     "bytes, absorption, kernel and engine live, decode speed when recorded"),
    ("11_speculative_decoding", "tokens per verify step against acceptance and k, what a "
     "verify step costs, the speed-up against the formula, prompt lookup",
     "memory-bound verify steps", "the tiny model live (host-bound steps)"),
]


def fingerprint_table() -> pd.DataFrame:
    fp = fingerprint()
    return pd.DataFrame({"value": [str(v) for v in fp.values()]}, index=list(fp))


def sequence_table(device: torch.device) -> pd.DataFrame:
    """The notebooks of the sequence and what runs live on this device."""
    on_gpu = device.type == "cuda"
    present = {p.stem for p in NOTEBOOK_DIR.glob("[0-9][0-9]*_*.ipynb")}
    return pd.DataFrame([{"notebook": stem, "what you see": sees,
                          "on this machine": "all live on the GPU" if on_gpu else cpu_part,
                          "needs a GPU for": gpu_part}
                         for stem, sees, gpu_part, cpu_part in SEQUENCE if stem in present])


def concept_map(device: torch.device | None = None) -> pd.DataFrame:
    """The chapter's concepts, the notebook sections and exercises that show each, and whether
    this machine shows it live or from a recording made on a GPU."""
    on_gpu = device is not None and torch.device(device).type == "cuda"

    def here(places, gpu):
        if not places:
            return "not yet written"
        return "live" if on_gpu or not gpu else "recorded on a GPU (the CPU parts live)"
    return pd.DataFrame([{"concept": c, "where": ", ".join(places) or "-",
                          "on this machine": here(places, gpu)} for c, places, gpu in CONCEPTS])


def place_exists(place: str, notebook_dir=NOTEBOOK_DIR) -> bool:
    """'06 §3' (a section heading of 06_*.ipynb), '02 §Eager mode' (a heading holding the text)
    or '04.2' (an exercise a notebook checks)."""
    import json
    import re

    section = re.fullmatch(r"(\d\d[a-z]?) §(.+)", place)
    if section is None:
        from labkit.teaching.exercises import all_exercises

        return place in all_exercises()
    stem, what = section.groups()
    paths = list(notebook_dir.glob(f"{stem}_*.ipynb"))
    if len(paths) != 1:
        return False
    headings = [line[3:] for c in json.loads(paths[0].read_text())["cells"]
                if c["cell_type"] == "markdown" for line in "".join(c["source"]).splitlines()
                if line.startswith("## ")]
    if what.isdigit():
        return any(re.match(rf"{what}\b", h) for h in headings)
    return any(what in h for h in headings)


def datasheet(gpu: str | None) -> dict | None:
    """The vendor's figures for ``gpu`` (a fingerprint's name), or None when it is not listed."""
    return DATASHEETS.get(gpu or "")


def ceilings_table(here: dict, gpu: str | None, recorded=None) -> pd.DataFrame:
    """This machine's ceilings (and the recording's, where there is one) beside the datasheet."""
    rows = [("this machine", here, gpu)]
    if recorded is not None:
        rows.append((f"recorded: {recorded.fingerprint['gpu']}", recorded.data,
                     recorded.fingerprint["gpu"]))
    out = []
    for name, d, g in rows:
        sheet = datasheet(g)
        out.append({"machine": name, "copy GB/s": d["copy_GBps"],
                    "matmul TFLOP/s": d["matmul_TFLOPs"], "matmul dtype": d["matmul_dtype"],
                    "ridge FLOP/B": ridge(d),
                    "copy / datasheet": d["copy_GBps"] / sheet["copy_GBps"] if sheet else None,
                    "matmul / datasheet": d["matmul_TFLOPs"] / sheet["matmul_TFLOPs"]
                    if sheet else None})
    return pd.DataFrame(out)


def ridge(ceil: dict) -> float:
    """FLOPs per byte moved at which a kernel stops being memory-bound: matmul rate / copy rate."""
    return ceil["matmul_TFLOPs"] * 1e12 / (ceil["copy_GBps"] * 1e9)


def ceiling_claims(ceil: dict, gpu: str | None, *, recorded=None) -> list:
    """What the two ceilings say: how close to the datasheet a real copy and a real matmul get
    (on a listed GPU), and which side of the ridge a batch-1 decode step falls."""
    where = f" on {gpu}" if recorded is not None else ""
    made = []
    sheet = datasheet(gpu)
    if sheet is not None:
        copy, mm = ceil["copy_GBps"] / sheet["copy_GBps"], ceil["matmul_TFLOPs"] / sheet["matmul_TFLOPs"]
        made += [
            claim("A device-to-device copy{where} moves {gbps:,.0f} GB/s: {frac:.0%} of the "
                  "datasheet's {sheet:,.0f} GB/s (the datasheet gives the memory's pin rate, which no "
                  "real access pattern reaches).", 0.6 < copy <= 1.02,
                  where=where, gbps=ceil["copy_GBps"], frac=copy, sheet=sheet["copy_GBps"],
                  recorded=recorded),
            claim("A {dtype} matmul on random data{where} runs at {tf:,.0f} TFLOP/s: {frac:.0%} "
                  "of the datasheet's dense {sheet:,.0f} (a peak at the boost clock, which sustained "
                  "tensor-core work does not hold).", 0.5 < mm <= 1.02, dtype=ceil["matmul_dtype"],
                  where=where, tf=ceil["matmul_TFLOPs"], frac=mm, sheet=sheet["matmul_TFLOPs"],
                  recorded=recorded),
        ]
    r = ridge(ceil)
    made.append(claim(
        "The ridge point{where} is {ridge:,.0f} FLOP per byte. A batch-1 decode step does about "
        "1 FLOP per byte of weights it reads (each 2-byte bf16 weight serves one multiply-add), "
        "{below:,.0f}x below it: decode is memory-bound, and its time follows its bytes.",
        r > 1, where=where, ridge=r, below=r, recorded=recorded))
    return made


def launch_floor_claim(launch_us: float, ceil: dict):
    """What one eager op's host cost buys on this device: the bytes a copy would move meanwhile."""
    kb = launch_us * 1e-6 * ceil["copy_GBps"] * 1e9 / 1e3
    return claim("Launching one tiny eager op costs {us:.1f} us of host time here; in that time "
                 "this device copies {kb:,.0f} KB. A kernel that moves less than that waits for "
                 "its launch, not for memory (notebook 01 measures the whole curve).",
                 launch_us > 0.5, us=launch_us, kb=kb)


def graph_floor(device, numel: int = 16, n_kernels: int = 64, rounds: int = 5) -> dict:
    """Per-kernel time of a chain of tiny ops, eager against one graph replay, in interleaved
    rounds (microseconds per kernel): the launch floor with and without the host."""
    from labkit.lessons.launch_overhead import per_kernel_rounds

    return per_kernel_rounds({m: (m, n_kernels) for m in ("eager", "graph")}, numel, device,
                             rounds, repeats=10)


def recorded_graph_floor(sweep: dict) -> dict:
    """The same two floors from notebook 01's recorded sweep, at its smallest size."""
    df = pd.DataFrame(sweep)
    small = df[df.numel == df.numel.min()].set_index("mode")
    return {"eager_us": [float(small.loc["eager", "us_per_kernel"])],
            "graph_us": [float(small.loc["graph", "us_per_kernel"])]}


def graph_floor_claim(floor: dict, recorded=None):
    """A graph replay's per-kernel floor against the eager launch's, per round."""
    from labkit.measure.rounds import Spread

    eager, graph = Spread.of(floor["eager_us"]), Spread.of(floor["graph_us"])
    gain = Spread.of([e / g for e, g in zip(floor["eager_us"], floor["graph_us"])])
    where = "" if recorded is None else f" on {recorded.fingerprint['gpu']} (recorded)"
    return claim("The third ceiling is the launch floor{where}: a tiny kernel costs {e:.2f} us "
                 "launched eagerly and {g:.2f} us replayed from a CUDA Graph, {x:.1fx} less{every}. "
                 "A graph leaves the GPU's own per-kernel cost; the host's share is gone.",
                 gain.above(1.0), where=where, e=eager, g=graph, x=gain,
                 every="" if gain.rounds == 1 else " in every round",
                 recorded=recorded)


def machines_claim(here: dict, recorded) -> object:
    """On a machine without a GPU: how far the recorded GPU's ceilings are from this one's."""
    x = recorded.data["copy_GBps"] / here["copy_GBps"]
    y = recorded.data["matmul_TFLOPs"] / here["matmul_TFLOPs"]
    return claim("The recorded {gpu} copies {x:,.0f}x and multiplies {y:,.0f}x faster than this "
                 "machine: which is why GPU timings here come from the recording, labelled.",
                 x > 1 and y > 1, gpu=recorded.fingerprint["gpu"], x=x, y=y)


def recording_agrees_claim(here: dict, recorded):
    """On the GPU a recording came from: today's ceilings against the recorded ones, so a GPU
    that is throttled or shared shows up before its figures are compared with anything."""
    copy = here["copy_GBps"] / recorded.data["copy_GBps"]
    mm = here["matmul_TFLOPs"] / recorded.data["matmul_TFLOPs"]
    return claim("Today's ceilings on this {gpu} are {copy:.0%} (copy) and {mm:.0%} (matmul) of "
                 "the recorded ones: the machine runs as it did when the lab's figures were "
                 "recorded.", 0.85 < copy < 1.15 and 0.8 < mm < 1.25, gpu=recorded.fingerprint["gpu"],
                 copy=copy, mm=mm)
