"""The engine: a Llama-style model and its weights, the continuous-batching scheduler, the
runner over the paged KV cache, and the LLM API that ties them together."""
from labkit.engine.config import ModelConfig
from labkit.engine.llm import LLM, EngineStats, RequestOutput, StepRecord
from labkit.engine.model import AttentionFn, LlamaModel
from labkit.engine.request import Request, ScheduledSeq, ScheduledStep, Status, StepStats
from labkit.engine.runner import ModelRunner, StepOutput
from labkit.engine.sampling import SamplingParams
from labkit.engine.scheduler import Scheduler, SchedulerConfig
from labkit.engine.speculative import SpeculativeConfig
from labkit.engine.step_metadata import StepMetadata, build_step_metadata
from labkit.engine.weights import (init_random, load_model, load_weights, random_model,
                                   save_weights)

__all__ = ["LLM", "AttentionFn", "EngineStats", "LlamaModel", "ModelConfig", "ModelRunner",
           "Request", "RequestOutput", "SamplingParams", "ScheduledSeq", "ScheduledStep",
           "Scheduler", "SchedulerConfig", "SpeculativeConfig", "Status", "StepMetadata",
           "StepOutput", "StepRecord", "StepStats", "build_step_metadata", "init_random",
           "load_model", "load_weights", "random_model", "save_weights"]
