"""A float64 yardstick for torch code that upcasts to fp32 on its own (`.float()`, `dtype=torch.float32`): the
independent high-precision run the fp32 noise floors are measured against (tests of the twin's gradients, of the
Kimi Linear layers)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class Float64Mode(TorchFunctionMode):
    """Evaluate torch code in float64 although it upcasts to fp32: `Tensor.float()` and every `torch.float32`
    argument become float64, and the default dtype is float64 inside (masks and buffers built with `torch.full`).
    Load the model, `.double()` it, then run it inside this mode."""

    def __enter__(self):
        self._old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._old)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: (torch.float64 if v is torch.float32 else v) for k, v in kwargs.items()}
        return func(*args, **kwargs)
