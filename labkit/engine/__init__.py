"""The engine: a Llama-style model, its weights, the continuous-batching scheduler and the
metadata a runner builds for each step (the runner and LLM API come next: issue 7)."""
from labkit.engine.config import ModelConfig
from labkit.engine.model import AttentionFn, LlamaModel
from labkit.engine.request import Request, ScheduledSeq, ScheduledStep, Status, StepStats
from labkit.engine.scheduler import Scheduler, SchedulerConfig
from labkit.engine.step_metadata import StepMetadata, build_step_metadata
from labkit.engine.weights import (init_random, load_model, load_weights, random_model,
                                   save_weights)

__all__ = ["AttentionFn", "LlamaModel", "ModelConfig", "Request", "ScheduledSeq", "ScheduledStep",
           "Scheduler", "SchedulerConfig", "Status", "StepMetadata", "StepStats",
           "build_step_metadata", "init_random", "load_model", "load_weights", "random_model",
           "save_weights"]
