"""Weights: from Hugging Face safetensors checkpoints, from a seed, and back to safetensors.

A checkpoint is one ``model.safetensors`` or several shards listed by
``model.safetensors.index.json``. ``safe_open`` memory-maps each file: a tensor is read from
disk only when it is asked for, so loading never holds a second copy of the whole model.

Every check (missing, unexpected, mis-shaped, non-float tensors) runs on the files' headers
before a single parameter is written, so a failed load leaves the model as it was.
"""
from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from labkit import check_positive_int
from labkit.engine.config import ModelConfig, read_json_object
from labkit.engine.mla import MLAModel
from labkit.engine.model import LlamaModel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # the names save_weights writes
# Buffers that older exports saved beside the parameters; they are recomputed, never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@contextmanager
def open_shard(file: Path):
    """``safe_open`` of one file, whose failure (a truncated or corrupt download) names it."""
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file} is not a readable safetensors file ({e}); it may be truncated "
                         "or still downloading: download it again") from None
    with handle as f:
        yield f


def hf_weight_map(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Hugging Face tensor name -> (labkit parameter, first row, end row) it fills.

    q/k/v land in row ranges of ``qkv_proj`` and gate/up in ``gate_up_proj``; the other
    tensors fill a whole parameter.
    """
    c = config
    q, kv, i = c.q_size, c.kv_size, c.intermediate_size
    out = {"model.embed_tokens.weight": ("embed_tokens", 0, c.vocab_size),
           "model.norm.weight": ("norm", 0, c.hidden_size)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = ("lm_head", 0, c.vocab_size)
    for n in range(c.num_hidden_layers):
        hf, ours = f"model.layers.{n}.", f"layers.{n}."
        out.update({
            hf + "input_layernorm.weight": (ours + "input_norm", 0, c.hidden_size),
            hf + "self_attn.q_proj.weight": (ours + "qkv_proj", 0, q),
            hf + "self_attn.k_proj.weight": (ours + "qkv_proj", q, q + kv),
            hf + "self_attn.v_proj.weight": (ours + "qkv_proj", q + kv, q + 2 * kv),
            hf + "self_attn.o_proj.weight": (ours + "o_proj", 0, c.hidden_size),
            hf + "post_attention_layernorm.weight": (ours + "post_attention_norm", 0,
                                                     c.hidden_size),
            hf + "mlp.gate_proj.weight": (ours + "gate_up_proj", 0, i),
            hf + "mlp.up_proj.weight": (ours + "gate_up_proj", i, 2 * i),
            hf + "mlp.down_proj.weight": (ours + "down_proj", 0, c.hidden_size),
        })
    return out


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, for a checkpoint folder or one file."""
    path = Path(path)
    if path.is_file() and path.suffix != ".safetensors":
        raise ValueError(f"{path} is not a safetensors file: pass the checkpoint folder "
                         f"({path.parent}) or one .safetensors file")
    if path.is_file():
        files = [path]
    elif (path / INDEX_FILE).is_file():
        index = read_json_object(path / INDEX_FILE, "the checkpoint's shard index")
        weight_map = index.get("weight_map")
        if weight_map is None:
            raise ValueError(f"{path / INDEX_FILE} has no 'weight_map' (tensor name -> shard "
                             "file); the index is incomplete: download it again")
        if not isinstance(weight_map, dict) or not all(
                isinstance(n, str) and isinstance(f, str) for n, f in weight_map.items()):
            raise ValueError(f"{path / INDEX_FILE}: 'weight_map' must map tensor names to shard "
                             f"files, got {type(weight_map).__name__}")
        out = {name: path / file for name, file in weight_map.items()}
        absent = sorted({str(f) for f in out.values() if not f.is_file()})
        if absent:
            raise FileNotFoundError(f"{INDEX_FILE} names shards that are not there: {absent}")
        return out
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights at {path} (looked for {INDEX_FILE}, "
                                f"{SINGLE_FILE} or any *.safetensors)")
    out = {}
    for file in files:
        with open_shard(file) as f:
            out.update((name, file) for name in f.keys())
    return out


def tensor_shapes(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype string), read from the headers only."""
    out = {}
    for file in sorted(set(files.values())):
        with open_shard(file) as f:
            for name in f.keys():
                if files.get(name) == file:
                    s = f.get_slice(name)
                    out[name] = (tuple(s.get_shape()), s.get_dtype())
    return out


def check_checkpoint(model: LlamaModel, files: dict[str, Path]) -> None:
    """Raises one ValueError naming every missing, unexpected or mis-shaped tensor."""
    params = dict(model.named_parameters())
    expected = hf_weight_map(model.config)
    header = tensor_shapes(files)
    tied_extra = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(set(expected) - set(header))
    unexpected = sorted(n for n in set(header) - set(expected) - tied_extra
                        if not n.endswith(IGNORED_SUFFIXES))
    wrong = []
    for name, (ours, start, end) in expected.items():
        if name not in header:
            continue
        want = (end - start, *params[ours].shape[1:])
        shape, dtype = header[name]
        if shape != want:
            wrong.append(f"{name}: checkpoint {list(shape)}, model expects {list(want)}")
        elif dtype not in ("F32", "F16", "BF16", "F64"):
            wrong.append(f"{name}: dtype {dtype} is not a float type")
    problems = ([f"missing: {', '.join(missing)}"] if missing else []) + \
               ([f"unexpected: {', '.join(unexpected)}"] if unexpected else []) + \
               ([f"wrong shape or dtype: {'; '.join(wrong)}"] if wrong else [])
    if problems:
        raise ValueError(
            "the checkpoint does not fit the model built from its config:\n  "
            + "\n  ".join(problems)
            + "\nCheck that config.json belongs to these weights (sizes, num_key_value_heads, "
              "tie_word_embeddings) and that the export is a Llama-architecture model.")


@torch.no_grad()
def load_weights(model: LlamaModel, path: str | Path) -> LlamaModel:
    """Fills ``model`` from a checkpoint folder or file, converting to the model's dtype."""
    files = checkpoint_files(path)
    check_checkpoint(model, files)
    params = dict(model.named_parameters())
    mapping = hf_weight_map(model.config)
    by_file: dict[Path, list[str]] = {}
    for name in mapping:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with open_shard(file) as f:
            for name in names:
                ours, start, end = mapping[name]
                params[ours][start:end].copy_(f.get_tensor(name))
    return model


def load_model(path: str | Path, device=None, dtype: torch.dtype | None = None, *,
               fused_ops: bool = False) -> LlamaModel:
    """Config and weights from a Hugging Face style folder (``config.json`` + safetensors)."""
    if Path(path).is_file():
        raise ValueError(f"{path} is a file: pass the checkpoint folder that holds config.json "
                         f"and the safetensors ({Path(path).parent})")
    config = ModelConfig.from_json(path)
    if config.is_mla:  # DeepSeek-style: transformers' own tensor names, no fused layout
        return load_mla_model(path, device=device, dtype=dtype)
    model = LlamaModel(config, device=device, dtype=dtype, fused_ops=fused_ops)
    return load_weights(model, path)


@torch.no_grad()
def init_random(model: LlamaModel, seed: int, std: float = 0.02) -> LlamaModel:
    """Matrices ~ N(0, std) and norm weights 1, as transformers initialises Llama.

    Values are drawn in float32 on the model's device and then rounded, so one seed gives the
    same model in every dtype on a given device type.
    """
    device = model.embed_tokens.device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0)
        else:
            p.copy_(torch.empty(p.shape, device=device).normal_(0.0, std, generator=generator))
    return model


def random_model(config: ModelConfig, seed: int = 0, device=None,
                 dtype: torch.dtype | None = None, std: float = 0.02, *,
                 fused_ops: bool = False) -> LlamaModel:
    """A model of ``config`` with random weights: LlamaModel, or MLAModel for an MLA config
    (which has no fused ops)."""
    if config.is_mla:
        return init_random(MLAModel(config, device=device, dtype=dtype), seed, std)
    return init_random(LlamaModel(config, device=device, dtype=dtype, fused_ops=fused_ops),
                       seed, std)


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face names, fused ones split, on the CPU."""
    params = dict(model.named_parameters())
    return {name: params[ours][start:end].detach().to("cpu").clone()
            for name, (ours, start, end) in hf_weight_map(model.config).items()}


def save_weights(model: LlamaModel, path: str | Path, max_shard_bytes: int | None = None
                 ) -> Path:
    """Writes ``config.json`` and safetensors that labkit and transformers both load.

    With ``max_shard_bytes``, tensors are split over several files with an index, as large
    checkpoints are published.
    """
    if not isinstance(model, LlamaModel):
        raise TypeError(f"save_weights takes a LlamaModel, got {type(model).__name__}; build one "
                        "with random_model(config) or load_model(folder)")
    if max_shard_bytes is not None:
        check_positive_int("max_shard_bytes", max_shard_bytes, hint="bytes per file, or None")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # A checkpoint saved here before in the other layout would shadow this one (an index wins
    # over model.safetensors): remove the files this function writes, and only those.
    for old in [path / INDEX_FILE, path / SINGLE_FILE, *path.glob("model-*-of-*.safetensors")]:
        if old.is_file() and (old.name in (INDEX_FILE, SINGLE_FILE) or SHARD_FILE.fullmatch(
                old.name)):
            old.unlink()
    config = model.config.to_dict()
    config["torch_dtype"] = str(model.embed_tokens.dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = hf_state_dict(model)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], path / SINGLE_FILE, metadata={"format": "pt"})
        return path
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return path


FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


@torch.no_grad()
def load_mla_model(path, device=None, dtype: torch.dtype | None = None) -> MLAModel:
    """A DeepSeek-style checkpoint folder (``config.json`` and safetensors under transformers'
    tensor names, every layer dense) -> MLAModel, converted to the model's dtype. Every missing,
    unexpected or mis-shaped tensor is named in one error before anything is copied."""
    model = MLAModel(ModelConfig.from_json(path), device=device, dtype=dtype)
    params = dict(model.named_parameters())
    files = checkpoint_files(path)
    header = tensor_shapes(files)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(set(params) - set(header) - tied)
    unexpected = sorted(n for n in set(header) - set(params) - tied
                        if not n.endswith(IGNORED_SUFFIXES))
    wrong = [f"{n}: checkpoint {list(header[n][0])} {header[n][1]}, model expects "
             f"{list(p.shape)}" for n, p in params.items()
             if n in header and (header[n][0] != tuple(p.shape) or header[n][1] not in FLOAT_DTYPES)]
    problems = ([f"missing: {', '.join(missing)}"] if missing else []) + \
               ([f"unexpected: {', '.join(unexpected)}"] if unexpected else []) + \
               ([f"wrong shape or dtype: {'; '.join(wrong)}"] if wrong else [])
    if problems:
        raise ValueError("the checkpoint does not fit the MLA model built from its config:\n  "
                         + "\n  ".join(problems) + "\nCheck that config.json belongs to these "
                         "weights and that every layer is dense (no experts)")
    by_file: dict = {}
    for name in params:
        if name in header:
            by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with open_shard(file) as f:
            for name in names:
                params[name].copy_(f.get_tensor(name))
    return model
