"""``python -m sparsetrain.pareto``: the same as ``sparsetrain pareto``."""
import sys

from sparsetrain.pareto.cli import main

sys.exit(main())
