"""A tiny DeepSeek-style (MLA) model and its transformers twin, shared by the MLA tests."""
import pytest
import torch

from labkit.engine.config import ModelConfig
from labkit.engine.mla import MLAModel

transformers = pytest.importorskip("transformers")

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20)


def tiny_mla(**overrides) -> ModelConfig:
    """Two dense layers, 4 heads; rms_norm_eps differs from the latent norms' fixed 1e-6 and
    v_head_dim from qk_nope_head_dim, so a model that mixes them up is caught."""
    return ModelConfig.tiny(num_key_value_heads=4, vocab_size=128, intermediate_size=96,
                            rms_norm_eps=1e-5, **{**MLA, **overrides})


def hf_model(config: ModelConfig, seed: int):
    """transformers' model on ``config``, its weights drawn at a scale where attention is not
    uniform and every norm weight matters."""
    torch.manual_seed(seed)
    hf_config = transformers.DeepseekV3Config(**config.to_dict())
    hf_config._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    return model


def mla_model(config: ModelConfig, seed: int) -> MLAModel:
    ours = MLAModel(config)
    ours.load_state_dict(hf_model(config, seed).state_dict(), strict=True)
    return ours.eval()
