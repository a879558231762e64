"""The engine: a Llama-style model, its weights, and (issue 7) the scheduler and runner."""
from labkit.engine.config import ModelConfig
from labkit.engine.model import AttentionFn, LlamaModel
from labkit.engine.weights import (init_random, load_model, load_weights, random_model,
                                   save_weights)

__all__ = ["AttentionFn", "LlamaModel", "ModelConfig", "init_random", "load_model",
           "load_weights", "random_model", "save_weights"]
