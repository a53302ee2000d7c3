"""Training benchmarks: throughput of the real training loop with 1..N Ray Train workers on
synthetic rows in a recipe's shapes, the time an epoch of that recipe takes at that rate,
(learning curves of finished runs: pipelines/train/curves.py).

Throughput runs the production ``train_loop_per_worker`` (collate, DDP, AdamW, the DFlash
loss with the target's real embedding and LM head) on rows in the stored format, so the
only thing left out is reading shards from storage.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path



# ---------------------------------------------------------------------------- throughput
@dataclasses.dataclass
class ThroughputConfig:
    target: str | None = None  # the recipe's target (embedding + LM head are real)
    target_dtype: str = "float32"
    hidden_size: int | None = None  # read from the target
    layer_ids: tuple[int, ...] = (1, 8, 14, 20, 27)
    num_layers: int = 2  # draft layers
    block_size: int = 8
    num_anchors: int = 32
    batch_size: int = 4
    prompt_tokens: int = 120
    response_tokens: int = 160
    rows: int = 32  # synthetic rows (each worker cycles through its share)
    steps: int = 4  # measured steps per worker count (after a warm-up window of as many)
    workers: tuple[int, ...] = (1, 2)
    threads_per_worker: int = 1
    epoch_rows: int = 912  # rows in one epoch of the recipe (960 prompts minus 5% held out)


def synthetic_rows(n: int, hidden: int, layer_ids, prompt: int, response: int, vocab: int, seed: int = 0) -> list:
    """Rows in the stored feature format (float16 features) with random content."""
    import torch

    from pipelines.features.format import FeatureLayout

    layout = FeatureLayout("float16", tuple(layer_ids), hidden)
    g = torch.Generator().manual_seed(seed)
    rows = []
    T = prompt + response
    for i in range(n):
        ids = torch.randint(4, vocab, (T,), generator=g)
        feats = torch.randn(T, layout.feature_dim, generator=g)
        data, _ = layout.encode(feats)
        rows.append({"id": f"s{i}", "input_ids": ids.tolist(), "loss_mask": [0] * prompt + [1] * response,
                     "num_tokens": T, "prompt_tokens": prompt, "finish_reason": "length", "features": data,
                     "scales": None})
    return rows, layout


def measure_throughput(cfg: ThroughputConfig, storage_path: str) -> dict:
    """Block tokens/s of the real training loop per worker count (DDP, CPU)."""
    import ray
    import ray.data
    from ray.train import DataConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipelines.train import train_loop_per_worker
    from pipelines.train.config import TrainSection
    from specdec.drafter import DFlashDrafter, drafter_config_for_target
    from specdec.frozen import load_embed_and_head

    head = load_embed_and_head(cfg.target, dtype=cfg.target_dtype)
    hidden, vocab = head.hidden_size, head.vocab_size
    dcfg = drafter_config_for_target(head, num_hidden_layers=cfg.num_layers, block_size=cfg.block_size,
                                     target_layer_ids=list(cfg.layer_ids), mask_token_id=0)
    init = ray.put({k: v.float() for k, v in DFlashDrafter(dcfg).state_dict().items()})
    rows, layout = synthetic_rows(cfg.rows, hidden, cfg.layer_ids, cfg.prompt_tokens, cfg.response_tokens, vocab)
    train_ds = ray.data.from_items(rows).materialize()
    holdout_ds = ray.data.from_items(rows[: cfg.batch_size]).materialize()
    results = []
    for n in cfg.workers:
        # two windows of cfg.steps steps, each closed by an evaluation: the first one warms up
        steps = 2 * cfg.steps
        tc = TrainSection(run_name=f"bench-{n}w-{int(time.time())}", storage_path=storage_path, epochs=10**6,
                          max_steps=steps, batch_size=cfg.batch_size, num_anchors=cfg.num_anchors,
                          eval_anchors=cfg.num_anchors, max_length=10**6, log_every=cfg.steps,
                          eval_every=cfg.steps,
                          shuffle_buffer=0, num_workers=n, threads_per_worker=cfg.threads_per_worker,
                          holdout_fraction=0.0, max_failures=0)
        config = {"train": dataclasses.asdict(tc), "drafter": dcfg.as_dict(), "init_state": init,
                  "target": {"model": cfg.target, "dtype": cfg.target_dtype, "trust_remote_code": False,
                             "identity": None},
                  "layout": layout.as_dict(), "train_rows": cfg.rows, "lam": None,
                  "mlflow": {"tracking_uri": None, "run_id": None, "live": False}}
        t0 = time.perf_counter()
        result = TorchTrainer(train_loop_per_worker, train_loop_config=config,
                              scaling_config=ScalingConfig(num_workers=n),
                              run_config=RunConfig(name=tc.run_name, storage_path=storage_path),
                              datasets={"train": train_ds, "holdout": holdout_ds},
                              dataset_config=DataConfig(datasets_to_split=["train"])).fit()
        with result.checkpoint.as_directory() as d:
            history = json.loads((Path(d) / "state.json").read_text())["history"]
        warm = history[-1]  # the second window
        rate, rows_per_s = warm.get("block_tokens_per_s"), warm.get("rows_per_s")
        results.append({"workers": n, "steps": steps, "block_tokens_per_s": rate, "rows_per_s": rows_per_s,
                        "step_seconds": cfg.batch_size * n / rows_per_s if rows_per_s else None,
                        "epoch_seconds": cfg.epoch_rows / rows_per_s if rows_per_s else None,
                        "wall_seconds": round(time.perf_counter() - t0, 1)})
    tokens_per_row = cfg.prompt_tokens + cfg.response_tokens
    return {"config": dataclasses.asdict(cfg), "hidden_size": hidden, "vocab_size": vocab,
            "block_tokens_per_step_per_worker": cfg.batch_size * cfg.num_anchors * cfg.block_size,
            "tokens_per_row": tokens_per_row, "results": results,
            "note": "block tokens = blocks x block size; epoch_seconds = epoch_rows / rows_per_s"}


def format_throughput(report: dict) -> str:
    lines = ["workers | block tok/s | rows/s | est. epoch (s)", "---|---|---|---"]
    for r in report["results"]:
        lines.append(f"{r['workers']} | {r['block_tokens_per_s']:.0f} | {r['rows_per_s']:.2f} | "
                     f"{r['epoch_seconds']:.0f}" if r["rows_per_s"] else f"{r['workers']} | - | - | -")
    return "\n".join(lines)

