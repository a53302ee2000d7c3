"""Prepare the embedded defaults once (``make assets``): de-quantize the SmolLM2 GGUF into the
safetensors cache (about 20 s, then seconds) and check the prompt sets are installed.

    python -m specdec.prepare
"""

from __future__ import annotations

import argparse

from specdec.assets import humaneval_jsonl, sharegpt_json
from specdec.target import resolve_target_path


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    print("target cache:", resolve_target_path(None))
    print("sharegpt:", sharegpt_json())
    print("humaneval:", humaneval_jsonl())


if __name__ == "__main__":
    main()
