"""Streamed features (``train.streamed: true``): Ray Data actors that hold the frozen target
compute the features of token rows and stream them straight into the Ray Train workers,
nothing stored. The actors (``train.stream``: count, CPUs, GPUs, batch) are scaled apart
from the trainers (``train.num_workers``), and their rows are the rows a stored run holds
(:func:`pipelines.features.format.shard_schema`, encoded in the recipe's storage layout),
so the workers' decoding, masks and evaluation are the stored path's own.
"""

from __future__ import annotations

import logging

import pyarrow as pa

from pipelines.config import ConfigError
from pipelines.features.format import FeatureLayout, shard_schema
from pipelines.train.config import TrainRecipe
from pipelines.train.runner import ONLINE_TEACHER_TOPK

log = logging.getLogger(__name__)


def stream_layout(recipe: TrainRecipe, layer_ids: list[int], hidden_size: int) -> FeatureLayout:
    """The layout streamed rows are encoded in: ``features.storage.dtype`` over the drafter's
    layers, with the target's top-K law when ``train.distill`` uses it (K as online)."""
    topk = ONLINE_TEACHER_TOPK if recipe.train.distill else 0
    return FeatureLayout(recipe.features.storage.dtype, tuple(layer_ids), hidden_size, topk)


class StreamFeatures:
    """Stateful Ray Data actor: token rows (``id``, ``input_ids``, ``loss_mask``) -> the
    rows of a stored feature run, features computed by this actor's copy of the target,
    in the order the rows came."""

    def __init__(self, target: dict, layer_ids: list[int], layout: dict, max_length: int, num_gpus: float,
                 num_cpus: float):
        from pipelines.features.target_pass import load_stage_target

        self.target = load_stage_target(target, num_gpus, num_cpus)
        if target.get("identity") and self.target.identity != target["identity"]:
            # the weights changed on disk after the driver planned the run
            raise ConfigError(f"features.target.model: the target's weights fingerprint is now "
                              f"{self.target.identity}, the run was planned with {target['identity']}")
        self.layer_ids = list(layer_ids)
        self.layout = FeatureLayout.from_manifest(layout)
        self.schema = shard_schema(layout)
        self.max_length = max_length

    def __call__(self, table: pa.Table) -> pa.Table:
        from pipelines.features.target_pass import target_features

        # the workers cut rows to max_length: the target never runs past it
        seqs = [s[: self.max_length] for s in table.column("input_ids").to_pylist()]
        masks = [m[: self.max_length] for m in table.column("loss_mask").to_pylist()]
        lens = [len(s) for s in seqs]
        feats, teacher = target_features(self.target, self.layer_ids, seqs, self.layout.teacher_topk)
        encoded = self.layout.encode_batch(feats, lens)
        law = self.layout.encode_teacher(*teacher, lens) if teacher is not None else [(None, None)] * len(seqs)
        return pa.table({
            "id": table.column("id").cast(pa.string()), "input_ids": pa.array(seqs, pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, pa.list_(pa.int8())), "num_tokens": pa.array(lens, pa.int32()),
            "prompt_tokens": pa.array([_prompt_tokens(m) for m in masks], pa.int32()),
            "finish_reason": pa.nulls(len(seqs), pa.string()),
            "features": pa.array([e[0] for e in encoded], pa.large_binary()),
            "scales": pa.array([e[1] for e in encoded], pa.large_binary()),
            "teacher_ids": pa.array([t[0] for t in law], pa.large_binary()),
            "teacher_logprobs": pa.array([t[1] for t in law], pa.large_binary()),
        }, schema=self.schema)


def _prompt_tokens(mask: list[int]) -> int:
    """Tokens before the first labelled one (a stored row's ``prompt_tokens``)."""
    return next((i for i, m in enumerate(mask) if m), len(mask))


def stream_features(ds, recipe: TrainRecipe, target_spec: dict, layer_ids: list[int], hidden_size: int):
    """``ds`` (token rows) through ``train.stream.actors`` target actors: a lazy Dataset of
    stored-layout rows that Ray Train streams into its workers (each epoch runs it again)."""
    st, tc = recipe.train.stream, recipe.train
    layout = stream_layout(recipe, layer_ids, hidden_size).as_dict()
    return ds.map_batches(
        StreamFeatures, batch_size=st.batch_size, batch_format="pyarrow", concurrency=st.actors,
        num_cpus=st.num_cpus, num_gpus=st.num_gpus or None,
        fn_constructor_kwargs={"target": target_spec, "layer_ids": list(layer_ids), "layout": layout,
                               "max_length": tc.max_length, "num_gpus": st.num_gpus, "num_cpus": st.num_cpus})


def stream_datasets(recipe: TrainRecipe, datasets: dict, target_spec: dict, layer_ids: list[int],
                    hidden_size: int) -> dict:
    """The plan's token datasets made streamed: the training rows lazily (every epoch runs
    the actors again), the held-out rows computed once and kept, as stored ones are."""
    check_stream_resources(recipe)
    train, holdout = (stream_features(datasets[k], recipe, target_spec, layer_ids, hidden_size)
                      for k in ("train", "holdout"))
    train.context.enable_progress_bars = False
    holdout = holdout.materialize()
    holdout.context.enable_progress_bars = False
    return {"train": train, "holdout": holdout}


def check_stream_resources(recipe: TrainRecipe) -> None:
    """Warn when the cluster as it is now cannot hold the target actors beside the
    trainers (an autoscaling cluster may still grow to it; a fixed one would wait forever)."""
    import ray

    tc, st = recipe.train, recipe.train.stream
    have = ray.cluster_resources()
    need = {"CPU": tc.min_workers * tc.cpus_per_worker + st.actors * st.num_cpus,
            "GPU": tc.min_workers * (1 if tc.use_gpu else 0) + st.actors * st.num_gpus}
    short = {k: (v, have.get(k, 0)) for k, v in need.items() if v > have.get(k, 0)}
    for k, (want, got) in short.items():
        log.warning("train.stream.actors: %d target actors + %d trainers need %g %s, the cluster has %g now; "
                    "they wait until it grows", st.actors, tc.min_workers, want, k, got)
