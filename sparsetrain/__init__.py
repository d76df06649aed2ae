"""sparsetrain: sparse training that is actually faster and smaller than dense.

>>> import sparsetrain as st
>>> layers = st.sparsify(model, targets=["*.intermediate.dense"], density=0.1, block=16)  # doctest: +SKIP
>>> sched = st.PruneRegrow(policy=st.SET(), drop_fraction=0.5, num_updates=160).attach(model, opt, 10_000)  # doctest: +SKIP
"""
from sparsetrain.nn import SparseLinear, WeightFormat, densify, register_format, sparsify
from sparsetrain.sparsity import (
    NM,
    SET,
    Block,
    Dense,
    GradualMagnitude,
    Magnitude,
    Policy,
    PruneRegrow,
    RigL,
    SparseLayer,
    SparseThenDense,
    SparsityScheduler,
    Static,
)

__version__ = "0.1.0"
__all__ = ["Block", "Dense", "GradualMagnitude", "Magnitude", "NM", "Policy", "PruneRegrow", "RigL", "SET",
           "SparseLayer", "SparseLinear", "SparseThenDense", "SparsityScheduler", "Static", "WeightFormat", "densify",
           "register_format", "sparsify"]
