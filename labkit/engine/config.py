"""The engine's two configs: the shape of a Llama-style decoder (``ModelConfig``, read from a
Hugging Face style ``config.json``) and the scheduler's budgets (``SchedulerConfig``).

A DeepSeek-V2/V3 ``config.json`` gives a ``ModelConfig`` whose ``is_mla`` is true: its attention
is multi-head latent attention (``labkit/engine/mla.py``), described by ``kv_lora_rank``,
``q_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim`` and ``v_head_dim``. Only its dense
layers are implemented: mixture-of-experts configs are refused.

Only the fields the model needs are kept; the rest of the file (tokenizer ids, ``use_cache``,
...) is ignored. Anything that would change the arithmetic and that labkit's model does not
implement (biases, another activation, scaled RoPE) is refused, so a checkpoint never loads
into a model that silently computes something else.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from labkit import check_positive_int

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_INT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    # multi-head latent attention (DeepSeek-V2/V3); all None for a Llama-style model
    kv_lora_rank: int | None = None      # the cached latent c_kv, shared by every head
    q_lora_rank: int | None = None       # None: q_proj straight from the hidden state
    qk_nope_head_dim: int | None = None  # the part of each query/key head without RoPE
    qk_rope_head_dim: int | None = None  # the rotary part; its key k_pe is shared and cached
    v_head_dim: int | None = None
    rope_interleave: bool | None = None  # MLA: RoPE pairs (x0, x1), (x2, x3)...; None: True

    def __post_init__(self):
        for name in _INT_FIELDS:
            check_positive_int(name, getattr(self, name))
        self._check_mla()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}): each KV head serves a "
                "whole group of query heads")
        if self.head_dim is None and self.is_mla:
            object.__setattr__(self, "head_dim", self.qk_head_dim)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        pairs = "RoPE rotates pairs of dimensions"
        check_positive_int("head_dim", self.head_dim, hint=pairs)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int ({pairs}), "
                             f"got {self.head_dim!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):  # "false" would be truthy: tied
            raise TypeError(f"tie_word_embeddings must be True or False, got "
                            f"{self.tie_word_embeddings!r}")
        if self.torch_dtype not in DTYPES:
            raise ValueError(f"torch_dtype must be one of {list(DTYPES)}, "
                             f"got {self.torch_dtype!r}")

    def _check_mla(self) -> None:
        given = [n for n in _MLA_FIELDS if getattr(self, n) is not None]
        if given and len(given) < len(_MLA_FIELDS):
            missing = [n for n in _MLA_FIELDS if n not in given]
            raise ValueError(f"multi-head latent attention needs {list(_MLA_FIELDS)} together; "
                             f"got {given} without {missing}: give all of them, or none for a "
                             "Llama-style model")
        if not given and self.q_lora_rank is not None:
            raise ValueError(f"q_lora_rank={self.q_lora_rank!r} is for multi-head latent "
                             f"attention: give {list(_MLA_FIELDS)} too, or drop it")
        if self.rope_interleave is not None and not isinstance(self.rope_interleave, bool):
            raise TypeError(f"rope_interleave must be True, False or None, got "
                            f"{self.rope_interleave!r}")
        if not given:
            if self.rope_interleave:
                raise ValueError("rope_interleave=True is for multi-head latent attention "
                                 "(DeepSeek's RoPE layout); a Llama-style model rotates halves")
            return
        for name in (*_MLA_FIELDS, "q_lora_rank"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs of "
                             f"dimensions), got {self.qk_rope_head_dim!r}")
        if self.rope_interleave is None:
            object.__setattr__(self, "rope_interleave", True)  # DeepSeek's checkpoints

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek) rather than Llama-style GQA."""
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """MLA: the width of one query/key head, its no-RoPE part then its rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """MLA: the values a token caches per layer, c_kv then k_pe (DeepSeek-V3: 576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.is_mla:
            heads, r, qr = self.num_attention_heads, self.kv_lora_rank, self.q_lora_rank
            q = h * heads * self.qk_head_dim if qr is None else h * qr + qr + qr * heads * \
                self.qk_head_dim
            kv = h * self.latent_size + r + r * heads * (self.qk_nope_head_dim + self.v_head_dim)
            layer = q + kv + heads * self.v_head_dim * h + 3 * h * i + 2 * h
        heads = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + heads + h

    @classmethod
    def from_dict(cls, config: dict) -> "ModelConfig":
        """From the dict of a Hugging Face ``config.json`` (transformers 4.x or 5.x names)."""
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict (the object a config.json holds), got "
                            f"{type(config).__name__}")
        mla = config.get("kv_lora_rank") is not None
        if mla or str(config.get("model_type", "")).startswith("deepseek"):
            _refuse_unsupported_mla(config)
        _refuse_unsupported(config)
        optional = ("max_position_embeddings", "num_key_value_heads")  # older files: MHA
        missing = [n for n in _INT_FIELDS if config.get(n) is None and n not in optional]
        if missing:
            raise ValueError(f"config.json lacks {missing}: a Llama-style config needs them")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in known and v is not None}
        kwargs.setdefault("num_key_value_heads", config["num_attention_heads"])
        if mla:
            kwargs.pop("head_dim", None)  # transformers writes the rotary width there
            if config.get("model_type") == "deepseek_v2":
                kwargs["rope_interleave"] = True  # V2 rotates adjacent pairs, with no flag
        rope = config.get("rope_parameters") or {}
        if "rope_theta" not in kwargs and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]  # transformers 5 nests it here
        dtype = config.get("torch_dtype") or config.get("dtype")  # renamed in transformers 5
        if dtype is not None:
            kwargs["torch_dtype"] = str(dtype).removeprefix("torch.")
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        """From a ``config.json`` file, or a checkpoint folder holding one."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if path.suffix == ".safetensors":
            raise ValueError(f"{path} is a weights file: pass the checkpoint folder that holds "
                             f"it and config.json ({path.parent})")
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        config = read_json_object(path, "the model's config")
        try:
            return cls.from_dict(config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    def to_dict(self) -> dict:
        """A ``config.json`` that labkit and transformers' ``LlamaForCausalLM`` both read."""
        out = asdict(self)
        out.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                   attention_bias=False, mlp_bias=False)
        if self.is_mla:  # DeepseekV3ForCausalLM's, every layer dense
            out.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                       first_k_dense_replace=self.num_hidden_layers,
                       head_dim=self.qk_rope_head_dim)  # transformers sizes its RoPE by it
        else:
            for name in (*_MLA_FIELDS, "q_lora_rank", "rope_interleave"):
                del out[name]
        return out

    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """Two layers, width 64, GQA (4 query / 2 KV heads): a forward takes milliseconds on CPU."""
        values = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def bench_1b(cls, **overrides) -> "ModelConfig":
        """The model the lab's recordings and benchmarks run on a GPU: 16 layers, width 2048,
        32 query / 8 KV heads, vocabulary 32,000, bf16; about 1.1B parameters."""
        values = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                      max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
                      torch_dtype="bfloat16")
        values.update(overrides)
        return cls(**values)


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in ``path``, or a ValueError naming the file and what is wrong with it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a JSON text file (it should hold {what}); is it a "
                         "weights file? Pass the checkpoint folder") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg}); "
                         "fix or download the file again") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object ({what}), got a "
                         f"{type(value).__name__}")
    return value


def _refuse_unsupported_mla(config: dict) -> None:
    """A DeepSeek config that asks for experts or YaRN, refused with what to set instead."""
    layers = config.get("num_hidden_layers")
    # transformers makes layer i a mixture of experts when i >= first_k_dense_replace
    dense = config.get("first_k_dense_replace",
                       3 if config.get("model_type") == "deepseek_v3" else 0)
    if isinstance(layers, int) and isinstance(dense, int) and dense < layers:
        raise ValueError(
            f"this DeepSeek config has mixture-of-experts layers (first_k_dense_replace={dense} "
            f"< num_hidden_layers={layers}, n_routed_experts={config.get('n_routed_experts')}): "
            "labkit runs dense MLP layers only. Set first_k_dense_replace to num_hidden_layers "
            f"({layers}) for a dense model, or use a dense checkpoint")
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) \
        if isinstance(scaling, dict) else scaling
    if rope_type != "default":
        raise ValueError(
            f"this DeepSeek config asks for {rope_type!r} RoPE scaling (DeepSeek's YaRN also "
            "scales the softmax by its mscale): labkit's MLA runs plain RoPE only. Drop "
            "rope_scaling, or set it to null, to run within the original context length")


def _refuse_unsupported(config: dict) -> None:
    problems = []
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config['hidden_act']!r} (labkit's MLP is SwiGLU: silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if config.get(bias):
            problems.append(f"{bias}=true (labkit's projections have no bias)")
    for name in ("rope_scaling", "rope_parameters"):
        if config.get(name) is not None and not isinstance(config[name], dict):
            raise ValueError(f"{name} must be an object such as {{\"rope_type\": \"default\"}} "
                             f"or null, got {config[name]!r}")
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        problems.append(f"rope_type {rope_type!r} (only plain RoPE is implemented)")
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        problems.append(f"sliding_window={config['sliding_window']} (attention here is full)")
    if problems:
        raise ValueError("this config asks for what labkit's Llama-style model does not "
                         "compute: " + "; ".join(problems)
                         + ". Use a Llama-architecture checkpoint or drop these fields.")


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold and how requests are scheduled (``labkit.engine.scheduler``)."""
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64              # running requests at once
    max_model_len: int = 2048           # prompt + output never goes past this
    enable_chunked_prefill: bool = True
    decode_buckets: tuple[int, ...] | None = None  # graph batch sizes, for padded-row stats
    vocab_size: int | None = None       # if given, prompt token ids are checked against it
    async_scheduling: bool = False      # schedule step N+1 before step N's tokens are known
    speculative: "SpeculativeConfig | None" = None  # draft tokens verified in decode rows

    def __post_init__(self):
        check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens,
                           hint="the token budget of one step")
        check_positive_int("max_num_seqs", self.max_num_seqs, hint="running requests at once")
        check_positive_int("max_model_len", self.max_model_len)
        if self.vocab_size is not None:
            check_positive_int("vocab_size", self.vocab_size, hint="or None: ids unchecked")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_num_seqs="
                f"{self.max_num_seqs}: a step could not hold one decode per running request; "
                "raise the budget or lower max_num_seqs")
        if self.decode_buckets is not None:
            buckets = tuple(sorted(set(self.decode_buckets)))
            if not buckets or buckets[0] < 1:
                raise ValueError(f"decode_buckets must be positive batch sizes, got "
                                 f"{self.decode_buckets!r}")
            object.__setattr__(self, "decode_buckets", buckets)
        if self.speculative is not None:
            from labkit.engine.speculative import SpeculativeConfig

            if not isinstance(self.speculative, SpeculativeConfig):
                raise TypeError(f"speculative must be a SpeculativeConfig or None, got "
                                f"{type(self.speculative).__name__}")
            draft = self.speculative.draft_model
            if draft is not None and self.vocab_size is not None and \
                    draft.config.vocab_size != self.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} "
                                 f"tokens) must be the target's ({self.vocab_size}): its tokens "
                                 "are checked as the target's")
            if self.speculative.method == "controlled" and self.vocab_size is None:
                raise ValueError("speculative method 'controlled' needs vocab_size: its wrong "
                                 "drafts are drawn from the vocabulary")
            if self.async_scheduling and self.speculative.method != "controlled":
                raise ValueError(f"speculative method {self.speculative.method!r} proposes "
                                 "from the request's tokens, which async scheduling has not "
                                 "read back yet: turn async_scheduling off, or use method "
                                 "'controlled' (its drafts depend on the position alone)")
