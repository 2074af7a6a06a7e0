"""The kernels one call launches (chapter 07): the Triton backend's by name ("triton.<name>")
and the PyTorch operators that compute ("torch.<op>"), in the interpreter on the CPU too."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

from minicb.attention import triton_ops

# PyTorch operators that launch no kernel: views, allocations, host scalars, and the copies the
# interpreter itself makes around a kernel
NOT_KERNELS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "alias", "detach", "t",
    "transpose", "permute", "expand", "unsqueeze", "squeeze", "select", "slice", "split",
    "split_with_sizes", "chunk", "unbind", "lift_fresh", "empty", "empty_like", "new_empty",
    "empty_strided", "set_", "scalar_tensor", "_local_scalar_dense"})


def count_launches(fn: Callable[[], object]) -> Counter:
    """Run fn() and count the kernels it launches."""
    counts: Counter = Counter()
    in_kernel = []  # inside a Triton launch, the interpreter's own operators are not counted

    class Operators(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not in_kernel and name not in NOT_KERNELS:
                counts["torch." + name] += 1
            return func(*args, **(kwargs or {}))

    class Counted:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                counts["triton." + self.kernel.__name__.strip("_")] += 1
                in_kernel.append(True)
                try:
                    return launch(*args, **kwargs)
                finally:
                    in_kernel.pop()
            return run

    # the backend's functions look their kernels up as module globals at each call
    module = vars(triton_ops)
    module.update({name: Counted(kernel) for name, kernel in triton_ops._KERNELS.items()})
    try:
        with Operators():
            fn()
    finally:
        module.update(triton_ops._KERNELS)
    return counts
