"""What every kernel package shares: device facts, the Triton launch fast path, the CUDA build, KernelOptions."""
from sparsetrain.kernels._runtime.options import (
    KernelOptions,
    kernel_options,
    set_kernel_options,
    use_kernel_options,
)

__all__ = ["KernelOptions", "kernel_options", "set_kernel_options", "use_kernel_options"]
