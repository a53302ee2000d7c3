"""What a training worker measures: held-out evaluation (loss, per-offset accuracy,
simulated greedy tau), each worker over its own held-out blocks (``heldout.py``), and the
running training statistics between progress lines; both summed over all workers."""

from __future__ import annotations

import time

import torch

from pipelines.train.config import TrainSection
from pipelines.train.data import Collate
from pipelines.train.heldout import HeldOut


def all_reduce(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` summed over the worker group (as it is when there is none); on the CPU."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        on = t.to(device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(on)
        return on.cpu()
    return t


@torch.no_grad()
def evaluate(runner, holdout: HeldOut, collate: Collate, tc: TrainSection, device: torch.device, rank: int,
             world: int, shard: bool = True) -> dict:
    """Held-out loss, per-offset accuracy and simulated greedy tau over every held-out
    sequence. Anchors are drawn from a seed fixed by the batch's sample ids, so every
    evaluation of a run scores the same blocks. With ``shard`` each worker reads and
    evaluates only its own held-out blocks (``HeldOut.owned``) and the sums are all-reduced
    (ZeRO-3 needs every rank in every forward, so there each rank evaluates all of them)."""
    B1 = runner.drafter.config.block_size - 1
    anchors = tc.eval_anchors or tc.num_anchors
    # sums: weighted loss, labelled tokens, leading matches, blocks, rows, hits per offset, labels per offset
    sums = torch.zeros(5 + 2 * B1, dtype=torch.float64)
    mine = holdout.owned(rank, world) if shard else list(range(len(holdout.blocks)))
    for raw in holdout.batches(mine, tc.batch_size):
        batch = collate(raw).to(device)
        gen = torch.Generator(device=device).manual_seed(batch.seed(tc.seed))
        out = runner.eval_step(batch, anchors, gen)
        if out.n_blocks == 0:
            continue
        count = out.acc_count.double().cpu()
        sums[0] += float(out.loss) * out.n_tokens
        sums[1] += out.n_tokens
        sums[2] += (float(out.tau) - 1) * out.n_blocks
        sums[3] += out.n_blocks
        sums[4] += batch.rows
        sums[5: 5 + B1] += out.acc.double().cpu() * count
        sums[5 + B1:] += count
    if shard:
        sums = all_reduce(sums, device)
    if sums[3] == 0:
        raise RuntimeError("the held-out set has no response tokens to evaluate")
    return {"holdout_loss": float(sums[0] / sums[1].clamp(min=1)), "holdout_tau": float(1 + sums[2] / sums[3]),
            "holdout_acc": [round(float(h / max(c, 1)), 5) for h, c in zip(sums[5: 5 + B1], sums[5 + B1:])],
            "holdout_blocks": int(sums[3]), "holdout_rows": int(sums[4])}


class TrainingWindow:
    """Running training statistics between progress lines and between evaluations."""

    def __init__(self, block_size: int):
        self.B1 = block_size - 1
        self.block_size = block_size
        self.since_eval: list[dict] = []
        self._reset()

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` (an evaluation) out of the throughput window."""
        self.t0 += seconds

    def _reset(self):
        # weighted loss, labelled tokens, leading matches, blocks, block tokens, rows, hits@k, labels@k
        self.sums = torch.zeros(6 + 2 * self.B1, dtype=torch.float64)
        self.t0 = time.perf_counter()

    def add(self, out, rows: int) -> None:
        s, B1 = self.sums, self.B1
        count = out.acc_count.double().cpu()
        s[0] += float(out.loss.detach()) * out.n_tokens
        s[1] += out.n_tokens
        s[2] += (float(out.tau) - 1) * out.n_blocks if out.n_blocks else 0.0
        s[3] += out.n_blocks
        s[4] += out.n_blocks * self.block_size
        s[5] += rows
        s[6: 6 + B1] += out.acc.detach().double().cpu() * count
        s[6 + B1:] += count

    def flush(self, device) -> dict:
        """Statistics of all workers since the last call (a collective)."""
        wall = max(time.perf_counter() - self.t0, 1e-9)
        s = all_reduce(self.sums.clone(), device)
        self._reset()
        s = [float(x) for x in s]
        stats = {"train_loss": s[0] / max(s[1], 1.0), "train_tau": 1 + s[2] / max(s[3], 1.0),
                 "train_acc_1": s[6] / max(s[6 + self.B1], 1.0),
                 "block_tokens_per_s": s[4] / wall, "rows_per_s": s[5] / wall}
        self.since_eval.append(stats)
        return stats

    def summary_since_eval(self) -> dict:
        """Mean training loss / tau / throughput over the progress lines since the last eval."""
        lines, self.since_eval = self.since_eval, []
        if not lines:
            return {}
        keys = ("train_loss", "train_tau", "block_tokens_per_s", "rows_per_s")
        return {k: round(sum(x[k] for x in lines) / len(lines), 5) for k in keys}
