"""Shared fixtures: tiny random targets (float64, so greedy ties cannot flip) and the
embedded SmolLM2 target."""

from __future__ import annotations

import functools
import os

import pytest
import torch

# Ray Train's preemption watcher is one more actor process per fit, polling for node drains;
# no test drains a node (losing one is tested by killing it), and on 2 cores each process
# start costs seconds. The clusters the tests start inherit this.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# Ray Train's controller polls its workers every 2 s by default: each fit waits up to that long
# to see its workers start, report and finish; the tests' fits are seconds long.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# vLLM's default thread binding pins an engine to all cores but one: on this 2-core machine every
# engine of every lane to core 0, while two lanes run engines at once. Unbound, with one thread
# each (what the engines Ray places get from their reservation), they share both cores.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tiny models gain nothing from intra-op threads, and spinning threads on a busy 2-core
# machine slow them by an order of magnitude.
torch.set_num_threads(1)
from specdec.tiny import tiny_target


@functools.lru_cache(maxsize=None)
def _tiny(family: str, vocab_size: int = 128):
    return tiny_target(family, vocab_size=vocab_size)


@pytest.fixture
def tiny():
    """Factory: tiny(family="llama", vocab_size=128) -> cached Target."""
    return _tiny


@pytest.fixture(scope="session")
def smollm2():
    from specdec.target import load_target

    return load_target(None)


# Modules that use these define a module-scoped ``work`` directory fixture.
@pytest.fixture(scope="module")
def target_dir(work):
    """A tiny target whose greedy output cycles: drafters can learn it in seconds."""
    from specdec.tiny import save_cyclic_target

    return save_cyclic_target(work / "cyclic-target")


@pytest.fixture(scope="module")
def target(target_dir):
    from specdec.target import load_target

    return load_target(str(target_dir))


@pytest.fixture(autouse=True, scope="module")
def _unit_modules_start_no_ray(request):
    """Modules marked ``pytest.mark.unit`` share one process (tools/run_tests.py): one that
    leaves Ray running there would hand its cluster to the next. Fail it by name instead."""
    yield
    if request.node.get_closest_marker("unit") is None:
        return
    import sys

    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), \
        f"{request.node.name} is marked unit but started Ray: remove the mark (it needs a process of its own)"
