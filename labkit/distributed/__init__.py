"""Several processes, one rank each: the rank runner (spawned here or joined under torchrun) and
a tensor-parallel MLP whose all-reduce runs serially or overlapped with compute."""
from labkit.distributed.rank_runner import RankContext, launched_by_torchrun, pick_backend, run_ranks
from labkit.distributed.tensor_parallel import (TensorParallelMLP, TPConfig, full_weights,
                                                mlp_reference, token_chunks)

__all__ = ["RankContext", "TPConfig", "TensorParallelMLP", "full_weights", "launched_by_torchrun",
           "mlp_reference", "pick_backend", "run_ranks", "token_chunks"]
