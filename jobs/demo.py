"""The main job end to end on the embedded defaults (what `make demo` runs):

  1. features  - SmolLM2 answers ShareGPT prompts; hidden states of 5 layers go to Parquet shards
  2. training  - the packaged reference drafter is registered in MLflow as the first @champion
                 (when it beats the target alone); a 2-layer DFlash drafter is fitted with Ray
                 Train and registered as a new version
  3. promotion - the new version is evaluated against @champion and promoted only if it wins
  4. benchmark - AR vs the packaged reference drafter (specdec/drafters/smollm2-135m, what
                 serving uses until a champion exists), alone and with prompt lookup beside it
                 (what serving runs), vs the oracle ceiling, exactness checked

Each step is the same command a user runs (`ray job submit -- python jobs/...`), here run on
a local Ray with a small budget so the whole demo takes minutes on a laptop CPU. Everything
lands under runs/demo/ (MLflow: sqlite:///runs/demo/mlflow.db). Re-running resumes/reuses.

    python jobs/demo.py [--prompts 64] [--max-new-tokens 64] [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = "configs/smollm2-135m.yaml"


def run(title: str, args: list[str], ok_codes: tuple[int, ...] = (0,)) -> int:
    print(f"\n=== {title}\n$ python {' '.join(args)}", flush=True)
    t0 = time.time()
    code = subprocess.run([sys.executable, *args], cwd=ROOT).returncode
    print(f"=== {title}: exit {code} in {time.time() - t0:.0f} s", flush=True)
    if code not in ok_codes:
        sys.exit(f"demo stopped: '{title}' failed (exit {code})")
    return code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument("--prompts", type=int, default=64, help="ShareGPT prompts answered by the target")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60, help="training steps (the full recipe: configs/smollm2-135m.yaml)")
    args = ap.parse_args()
    out = args.out
    mlflow = f"sqlite:///{ROOT / out / 'mlflow.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = mlflow
    (ROOT / out).mkdir(parents=True, exist_ok=True)

    run("1/4 features", ["jobs/generate_features.py", "--config", CONFIG,
                         "--set", f"features.output={out}/features",
                         "--set", f"features.prompts.limit={args.prompts}",
                         "--set", f"features.generation.max_new_tokens={args.max_new_tokens}",
                         "--set", "features.storage.samples_per_shard=16"])
    from specdec.assets import reference_drafter_for

    promote = ["jobs/promote_drafter.py", "--tracking-uri", mlflow, "--model", "dflash-smollm2-135m",
               "--prompts", "sharegpt", "--num-prompts", "4", "--max-new-tokens", "32"]
    reference = reference_drafter_for(None)
    if reference is not None:  # registered once (same weights: the same version), judged vs the target alone
        run("2/4 registry: the packaged reference drafter as the first champion",
            [*promote, "--register", str(reference)], ok_codes=(0, 1))
    run("2/4 training", ["jobs/train_drafter.py", "--config", CONFIG,
                         "--set", f"features.output={out}/features",
                         "--set", f"train.storage_path={out}/train",
                         "--set", "train.run_name=demo",
                         "--set", f"train.max_steps={args.steps}",
                         "--set", "train.eval_every=20",
                         "--set", "train.holdout_fraction=0.1",
                         "--set", f"registry.tracking_uri={mlflow}"])
    drafter = f"{out}/train/demo/drafter"
    run("3/4 promotion: the demo drafter vs @champion", [*promote, "--challenger", "latest"], ok_codes=(0, 1))

    bench_drafter = str(reference or drafter)  # the one that pays, when shipped
    run("4/4 benchmark", ["jobs/benchmark.py", "--drafter", bench_drafter, "--prompts", "sharegpt",
                          "--num-prompts", "4", "--max-new-tokens", str(args.max_new_tokens),
                          "--methods", "ar,dflash,dflash_lookup,oracle", "--out", f"{out}/bench.json"])
    print(f"""
Done. Artifacts under {out}/: features/ (manifest.json + shards), train/demo/ (checkpoints, drafter/),
bench.json + bench.png, mlflow.db.

Next (serving follows @champion; until there is one, the packaged reference drafter):
  MLFLOW_TRACKING_URI={mlflow} serve run serve_app:app
  curl -s 127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model": "smollm2-135m", "messages": [{{"role": "user", "content": "Hi!"}}]}}'
The demo drafter saw {args.prompts} prompts for {args.steps} steps; the full CPU recipe is
`python jobs/generate_features.py --config {CONFIG}` then `python jobs/train_drafter.py --config {CONFIG}`.""")


if __name__ == "__main__":
    main()
