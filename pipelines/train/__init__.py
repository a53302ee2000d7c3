"""The training stage (Ray Train): ``trainer.py`` runs a recipe on the driver (``fit``),
``plan.py`` checks and plans it before any worker starts, ``longalign_rows.py`` turns
``train.longalign`` into token rows, ``worker.py`` is ``train_loop_per_worker``,
``metrics.py`` its held-out evaluation and training statistics, ``export.py`` the export
and registration of the best drafter, ``config.py`` the recipe sections, ``data.py``
batches from stored or online features, ``runner.py`` the DDP/DeepSpeed step and
checkpoints, ``curves.py`` learning curves.

The names below load on first use (pipelines/lazy.py says why)."""

from pipelines.lazy import lazy_exports

_NAMES = {"fit": "trainer", "lr_at": "worker", "train_loop_per_worker": "worker", "CHECKPOINT_PREFIX": "runner",
          "latest_checkpoint_state": "runner"}
__all__ = sorted(_NAMES)
__getattr__ = lazy_exports(__name__, _NAMES)
