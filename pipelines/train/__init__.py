"""The training stage (Ray Train): ``trainer.py`` prepares and runs a recipe (driver side and
``train_loop_per_worker``), ``config.py`` the recipe sections, ``data.py`` batches from
stored or online features, ``runner.py`` the DDP/DeepSpeed step and checkpoints,
``curves.py`` learning curves, ``bench.py`` and ``recipe_bench.py`` the benchmarks."""

from pipelines.train.trainer import fit, lr_at, train_loop_per_worker
from pipelines.train.runner import CHECKPOINT_PREFIX, latest_checkpoint_state

__all__ = ["CHECKPOINT_PREFIX", "fit", "latest_checkpoint_state", "lr_at", "train_loop_per_worker"]
