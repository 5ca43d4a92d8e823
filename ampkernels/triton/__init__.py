"""Triton backend kernels (layer_norm, linear_act)."""
import contextlib
import functools

import torch


def on_device(x):
    """Triton launches on the current device: switch to x's device only when it lives
    elsewhere (the switch costs host time on every call)."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def cdiv(a, b):
    """Ceiling division for launch grids in host code: triton.cdiv is a constexpr_function in
    Triton 3.8 (argument unwrapping on every call), several microseconds a call on the host."""
    return -(-a // b)


def device_index(device):
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(None)
def device_properties(index):
    """torch.cuda.get_device_properties, cached: microseconds a call uncached, and the launchers
    ask on every call (SM count, shared memory, compute capability)."""
    return torch.cuda.get_device_properties(index)
