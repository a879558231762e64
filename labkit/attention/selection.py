"""Which attention backend serves a model, its cache, its requests, its graphs and its hardware.

``select_backend(spec)`` walks ``backends.PRIORITY`` and takes the first backend with no reason
against the spec, logging why each earlier one was passed over. ``prefer="name"`` forces one:
if it cannot serve the spec, the error lists every reason instead of silently falling back.
This is the one place a backend is chosen: the engine's runner and the model's varlen path ask
it too (``skip_slow=True``: on CPU they pass over what would compute right but slowly).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from labkit import check_positive_int, check_power_of_two
from labkit.attention.backends import BACKENDS, PRIORITY, Backend

log = logging.getLogger("labkit.attention")

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
KV_SCALES = ("none", "per_tensor", "per_kv_head", "per_token")
GRAPH_MODES = ("none", "uniform_decode", "full")  # what the caller wants to capture
_GRAPH_NEEDS = {"none": ("always", "uniform_decode", "never"),
                "uniform_decode": ("always", "uniform_decode"), "full": ("always",)}
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Why auto selection with skip_slow passes over a backend on CPU although it computes right.
CPU_SLOW = {
    "triton": "hardware: on CPU its kernels run in Triton's interpreter (about 0.1 s a call); "
              "force backend='triton' to run them anyway",
    "flex": "hardware: on CPU labkit runs flex_attention uncompiled, materialising every score "
            "(slow); force backend='flex' to run it anyway",
}


@dataclass(frozen=True)
class AttentionSpec:
    """Everything a backend must match. ``block_size=None`` means a contiguous (unpaged) cache."""
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    mla: bool = False  # multi-head latent attention (DeepSeek): a compressed latent KV
    sliding_window: int | None = None
    kv_cache_dtype: str = "auto"
    kv_scale: str = "none"
    block_size: int | None = 16
    mixed_batch: bool = True  # prefill chunks and decode tokens in one batch
    cuda_graph: str = "none"
    device: str = "cuda"
    compute_capability: tuple[int, int] | None = None  # None: any

    def __post_init__(self):
        if isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", _DTYPES.get(self.dtype, self.dtype))
        for name in ("num_q_heads", "num_kv_heads", "head_dim"):
            check_positive_int(name, getattr(self, name))
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads ({self.num_q_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be a floating-point torch dtype, one of "
                             f"{list(_DTYPES.values())} or its name {list(_DTYPES)}, "
                             f"got {self.dtype!r}")
        for name in ("mla", "mixed_batch"):  # a string such as "no" would be truthy
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        cc = self.compute_capability
        if cc is not None and not (isinstance(cc, tuple) and len(cc) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in cc)):
            raise ValueError(f"compute_capability must be a (major, minor) tuple of ints such "
                             f"as (9, 0), or None for any GPU; got {cc!r}")
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window,
                               hint="or None: full attention")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_scale not in KV_SCALES:
            raise ValueError(f"kv_scale must be one of {KV_SCALES}, got {self.kv_scale!r}")
        if (self.kv_cache_dtype == "auto") != (self.kv_scale == "none"):
            raise ValueError(f"kv_scale={self.kv_scale!r} with kv_cache_dtype="
                             f"{self.kv_cache_dtype!r}: a quantised cache needs a scale "
                             "granularity and an unquantised one has none")
        if self.block_size is not None:
            check_power_of_two("block_size", self.block_size, hint="or None: a contiguous cache")
        if self.cuda_graph not in GRAPH_MODES:
            raise ValueError(f"cuda_graph must be one of {GRAPH_MODES}, got {self.cuda_graph!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")

    @property
    def attention_kind(self) -> str:
        if self.mla:
            return "MLA"
        if self.num_kv_heads == self.num_q_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @classmethod
    def here(cls, device: str | torch.device | None = None, **fields) -> AttentionSpec:
        """A spec for ``device`` (default: this machine's GPU, else its CPU) and, on a GPU, its
        compute capability."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            return cls(device="cuda", compute_capability=(props.major, props.minor), **fields)
        return cls(device=device.type, **fields)


def reasons_against(backend: Backend, spec: AttentionSpec) -> list[str]:
    """Every way ``backend`` fails ``spec``; an empty list means it can serve it. A reason the
    backend declares a limit for ends with whose limit it is (``Backend.limits``)."""
    b, s, why = backend, spec, []

    def refuse(check: str, reason: str) -> None:
        limit = b.limit(check)
        why.append(reason if limit is None else f"{reason}; limit of {limit.by}")

    if s.attention_kind not in b.attention_kinds:
        refuse(s.attention_kind, f"model: {s.attention_kind} attention is not supported "
                                 f"(supports {'/'.join(b.attention_kinds)})")
    # an MLA spec's head_dim is the latent row's width, which the backend's mla call takes
    # whole (paged_mla_attention checks its two parts): the head sizes are its paged kernel's
    serves_mla = s.mla and b.mla is not None
    if b.head_dims is not None and s.head_dim not in b.head_dims and not serves_mla:
        refuse("head dims", f"model: head_dim {s.head_dim} is not supported "
                            f"({_short(b.head_dims)})")
    if s.sliding_window is not None and not b.sliding_window:
        refuse("sliding window", "model: no sliding window")
    if s.dtype not in b.dtypes:
        refuse("query dtypes", f"model: dtype {s.dtype} is not supported ({_short(b.dtypes)})")
    if s.kv_cache_dtype not in b.kv_cache_dtypes:
        refuse("KV cache dtypes", f"cache: KV dtype {s.kv_cache_dtype} is not supported "
                                  f"({'/'.join(b.kv_cache_dtypes)})")
    elif s.kv_scale != "none" and s.kv_scale not in b.kv_scales:
        refuse("KV scale granularity", f"cache: {s.kv_scale} scales are not supported "
                                       f"({'/'.join(b.kv_scales) or 'none'})")
    if s.block_size is not None and b.block_sizes is not None and \
            s.block_size not in b.block_sizes:
        refuse("block sizes", f"cache: block_size {s.block_size} is not supported "
                              f"({_short(b.block_sizes)})")
    if s.mixed_batch and not b.mixed_batches:
        refuse("mixed prefill + decode", "request: cannot mix prefill and decode in one batch")
    if b.cuda_graphs not in _GRAPH_NEEDS[s.cuda_graph]:
        refuse("CUDA Graph capture", f"graph: capture of {s.cuda_graph} batches is not "
                                     f"supported (CUDA Graphs: {b.cuda_graphs})")
    if s.device not in b.devices:
        refuse("devices", f"hardware: runs on {'/'.join(b.devices)}, not {s.device}")
    elif s.device == "cuda" and s.compute_capability is not None:
        need, check = b.min_compute_capability, "compute capability"
        fp8_need = b.fp8_min_compute_capability if s.kv_cache_dtype == "fp8_e4m3" else None
        if fp8_need and fp8_need > (need or (0, 0)):
            if tuple(s.compute_capability) >= (need or (0, 0)):
                check = "fp8 cache needs"  # the GPU is new enough for the rest, not for fp8
            need = fp8_need
        if need and tuple(s.compute_capability) < need:
            refuse(check, f"hardware: needs compute capability {need[0]}.{need[1]}+, this GPU "
                          f"is {s.compute_capability[0]}.{s.compute_capability[1]}")
    return why


def _short(values) -> str:
    values = list(values)
    text = ", ".join(str(v).replace("torch.", "") for v in values[:6])
    return text + (f", ... {values[-1]}" if len(values) > 6 else "")


class BackendUnavailable(ValueError):
    def __init__(self, message: str, reasons: dict[str, list[str]]):
        super().__init__(message)
        self.reasons = reasons


def select_backend(spec: AttentionSpec, prefer: str | None = None, *,
                   among: Sequence[str] = PRIORITY, skip_slow: bool = False,
                   logger: logging.Logger | None = log) -> tuple[Backend, dict[str, list[str]]]:
    """Returns (backend, passed): for every other backend of ``among``, why it was passed over.

    Auto (``prefer=None``) takes the first of ``among`` (in priority order) with no reason
    against ``spec``; with ``skip_slow``, a CPU spec also passes over the backends of
    ``CPU_SLOW``. The choice and every reason are logged once, to ``logger`` (None: not logged).
    """
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be an AttentionSpec, got {type(spec).__name__}; build one "
                        "with AttentionSpec(num_q_heads, num_kv_heads, head_dim, ...)")
    if isinstance(among, str):
        raise TypeError(f"among must be a list of backend names, got the string {among!r}; "
                        f"pass [{among!r}]")
    among = tuple(among)
    unknown = [name for name in among if name not in BACKENDS]
    if unknown:
        raise ValueError(f"among holds unknown backends {unknown}; known: {list(BACKENDS)}")
    reasons = {name: reasons_against(BACKENDS[name], spec) for name in among}
    if prefer is None and skip_slow and spec.device == "cpu":
        reasons = {name: why + ([CPU_SLOW[name]] if name in CPU_SLOW else [])
                   for name, why in reasons.items()}
    if prefer is not None:
        if prefer not in BACKENDS:
            raise ValueError(f"unknown backend {prefer!r}; known: {list(BACKENDS)}")
        reasons.setdefault(prefer, reasons_against(BACKENDS[prefer], spec))
        if reasons[prefer]:
            raise BackendUnavailable(
                f"backend {prefer!r} was forced but cannot serve {spec}:\n  - "
                + "\n  - ".join(reasons[prefer])
                + "\nDrop prefer= to let auto selection choose, or change the spec.", reasons)
        chosen = prefer
    else:
        chosen = next((n for n in among if not reasons[n]), None)
        if chosen is None:
            lines = [f"  {n}: {'; '.join(r)}" for n, r in reasons.items()]
            raise BackendUnavailable(f"no attention backend can serve {spec}:\n"
                                     + "\n".join(lines), reasons)
    passed = {}
    for name in among:
        if name == chosen:
            continue
        passed[name] = reasons[name] or [
            f"compatible, but {chosen!r} was forced" if prefer else
            f"compatible, but after {chosen!r} in the priority order {list(among)}"]
    if logger is not None:
        for line in selection_lines(chosen, passed, forced=prefer is not None, spec=spec):
            logger.info(line)
    return BACKENDS[chosen], passed


def selection_lines(chosen: str, passed: dict[str, list[str]], *, forced: bool,
                    spec: AttentionSpec) -> list[str]:
    """The log of one selection, as lines a notebook can print."""
    lines = [f"attention backend {chosen!r} for {spec.attention_kind} "
             f"({'forced' if forced else 'auto'})"]
    lines += [f"  passed over {name!r}: {'; '.join(why)}" for name, why in passed.items()]
    return lines


MLA_LATENT, MLA_ROPE = 512, 64  # DeepSeek-V3's kv_lora_rank and qk_rope_head_dim (config.json)


def example_specs(device: str = "cuda", compute_capability=(9, 0)) -> dict[str, AttentionSpec]:
    """Model shapes worth selecting for (head counts as published for these models)."""
    hw = dict(device=device, compute_capability=compute_capability if device == "cuda" else None)
    return {
        "MHA (Llama-2-7B)": AttentionSpec(32, 32, 128, **hw),
        "GQA (Llama-3-8B)": AttentionSpec(32, 8, 128, **hw),
        "sliding window (Mistral-7B)": AttentionSpec(32, 8, 128, sliding_window=4096, **hw),
        "GQA + fp8 KV cache": AttentionSpec(32, 8, 128, kv_cache_dtype="fp8_e4m3",
                                            kv_scale="per_kv_head", **hw),
        "GQA, decode in CUDA Graphs": AttentionSpec(32, 8, 128, cuda_graph="uniform_decode",
                                                    **hw),
        # DeepSeek-V3 (config.json): 128 query heads read one latent per token, 576 wide:
        # kv_lora_rank 512 (the compressed K/V) + qk_rope_head_dim 64 (the decoupled RoPE key),
        # shared by every head. With the up-projections absorbed into the query and output
        # weights, attention runs over that one cached "head": MQA-like, 128 to 1.
        "MLA (DeepSeek-V3)": AttentionSpec(128, 1, MLA_LATENT + MLA_ROPE, mla=True, **hw),
    }


def explain(spec: AttentionSpec) -> list[dict]:
    """One row per backend, in priority order: whether it can serve ``spec``, and why not."""
    return [{"backend": n, "compatible": not reasons_against(BACKENDS[n], spec),
             "reasons": "; ".join(reasons_against(BACKENDS[n], spec))} for n in PRIORITY]
