"""Package names that import their module on first use.

Ray Data's read tasks and Ray Train's helper actors import the modules whose functions they
run (``pipelines.train.data``, ``pipelines.features.reader``), and with them their packages: a
package ``__init__`` that imported its driver (the trainer, the feature pipeline) would cost
each of those processes torch, Ray Train and DeepSpeed's imports, seconds of CPU apiece."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, names: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``names`` maps each public name to the
    submodule that defines it, imported when the name is first read."""
    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{names[name]}"), name)

    return __getattr__
