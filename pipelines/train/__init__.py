"""The training stage (Ray Train): ``trainer.py`` runs a recipe on the driver (``fit``),
``plan.py`` checks and plans it before any worker starts, ``longalign_rows.py`` turns
``train.longalign`` into token rows, ``worker.py`` is ``train_loop_per_worker``,
``metrics.py`` its held-out evaluation and training statistics, ``export.py`` the export
and registration of the best drafter, ``config.py`` the recipe sections, ``data.py``
batches from stored or online features, ``runner.py`` the DDP/DeepSpeed step and
checkpoints, ``curves.py`` learning curves."""

from pipelines.train.trainer import fit
from pipelines.train.worker import lr_at, train_loop_per_worker
from pipelines.train.runner import CHECKPOINT_PREFIX, latest_checkpoint_state

__all__ = ["CHECKPOINT_PREFIX", "fit", "latest_checkpoint_state", "lr_at", "train_loop_per_worker"]
