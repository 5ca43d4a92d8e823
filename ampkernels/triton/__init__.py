"""Triton backend kernels (layer_norm, linear_act)."""
import contextlib

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
