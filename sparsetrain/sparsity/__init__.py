"""Pure sparsity logic: layouts, distributions, criteria, mask updates, schedules, N:M masks, schedulers.
Imports neither ``nn`` nor ``kernels``: layers are seen through the :class:`SparseLayer` protocol."""
from sparsetrain.sparsity.distributions import erdos_renyi, erk, layer_densities, uniform
from sparsetrain.sparsity.gradual import GradualMagnitude
from sparsetrain.sparsity.layout import Block, n_active_blocks, to_element_mask
from sparsetrain.sparsity.nm import NM, nm_mask, transposable_nm_mask
from sparsetrain.sparsity.policies import SET, Magnitude, Policy, RigL, get_policy
from sparsetrain.sparsity.protocol import FormatCaps, SparseLayer
from sparsetrain.sparsity.schedulers import Dense, PruneRegrow, SparsityScheduler, Static, sparse_layers
from sparsetrain.sparsity.schedules import Constant, CosineDecay, CubicDensity, LinearDecay, UpdateSchedule
from sparsetrain.sparsity.two_four import SparseThenDense
from sparsetrain.sparsity.update import MaskUpdate, prune_to, update_mask

__all__ = [
    "Block", "Constant", "CosineDecay", "CubicDensity", "Dense", "FormatCaps", "GradualMagnitude", "LinearDecay",
    "Magnitude", "MaskUpdate", "NM", "Policy", "PruneRegrow", "RigL", "SET", "SparseLayer", "SparseThenDense",
    "SparsityScheduler", "Static", "UpdateSchedule", "erdos_renyi", "erk", "get_policy", "layer_densities",
    "n_active_blocks", "nm_mask", "prune_to", "sparse_layers", "to_element_mask", "transposable_nm_mask", "uniform",
    "update_mask",
]
