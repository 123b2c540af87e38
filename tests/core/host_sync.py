"""Guards that fail a test when code reads device values on the host: what a CUDA-graph-captured step must never do
(a capture fails on it, and outside capture it stalls the host on the device), checked on the CPU."""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops whose result's value or shape depends on tensor data, so they read it on the host
DATA_DEPENDENT = {aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default,
                  aten.masked_select.default, aten.unique_consecutive.default, aten._unique2.default,
                  aten.unique_dim.default, aten.repeat_interleave.Tensor, aten.equal.default, aten.is_nonzero.default}


class NoHostSync(TorchDispatchMode):
    """Raises on any aten op that reads a device value on the host or has a data-dependent output shape, and on any
    copy from another device to the CPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in DATA_DEPENDENT:
            raise AssertionError(f"host sync: {func}")
        if func in (aten._to_copy.default, aten.copy_.default):
            src = args[1] if func is aten.copy_.default else args[0]
            dst = args[0].device if func is aten.copy_.default else kwargs.get("device") or src.device
            if torch.device(dst).type == "cpu" and src.device.type != "cpu":
                raise AssertionError(f"host sync: {func} to the CPU")
        return func(*args, **kwargs)


class NoHostCopy(TorchFunctionMode):
    """Raises on the Tensor methods that copy values to the host without an aten op (`tolist`, `numpy`) and on
    those that read one (`item`, `bool`, `int`, `float`)."""

    BANNED = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.__bool__,
              torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.BANNED:
            raise AssertionError(f"host sync: {func.__name__}")
        return func(*args, **(kwargs or {}))


class HostReads(TorchFunctionMode):
    """Counts (does not raise) the Tensor methods that read values on the host (`NoHostCopy.BANNED`, and `.cpu()`):
    `seen` holds each as "name file:line in function", of the first caller outside torch itself."""

    COUNTED = NoHostCopy.BANNED | {torch.Tensor.cpu}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.COUNTED:
            frame = sys._getframe(1)
            while frame.f_back is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
                frame = frame.f_back
            self.seen.append(f"{func.__name__} {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        return func(*args, **(kwargs or {}))
