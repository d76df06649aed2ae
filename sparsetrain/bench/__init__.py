"""What ``sparsetrain bench NAME [args]`` runs: GPU benchmarks shipped in the wheel.

Each entry is a module with ``main(argv: list[str]) -> int`` that prints ratios against dense measured side by
side in one process (never timed assertions).
"""
from __future__ import annotations

import importlib

BENCHES = {
    "blocksparse": "sparsetrain.bench.blocksparse",
    "semi24": "sparsetrain.bench.semi24",
    "inference": "sparsetrain.bench.inference",
    "e2e": "sparsetrain.bench.e2e",
    "attention": "sparsetrain.bench.attention",
}


def run(name: str, argv: list[str]) -> int:
    """Run benchmark ``name`` with its own command-line ``argv``."""
    if name not in BENCHES:
        raise KeyError(f"unknown benchmark {name!r}; known: {sorted(BENCHES)}")
    return int(importlib.import_module(BENCHES[name]).main(list(argv)) or 0)
