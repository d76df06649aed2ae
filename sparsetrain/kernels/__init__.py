"""GPU kernels: the bottom floor. Knows no layer, scheduler or config; one package per op."""
from sparsetrain.kernels._runtime.options import (
    KernelOptions,
    kernel_options,
    set_kernel_options,
    use_kernel_options,
)

__all__ = ["KernelOptions", "kernel_options", "set_kernel_options", "use_kernel_options"]
