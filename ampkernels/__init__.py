"""ampkernels: fused mixed-precision kernels for PyTorch AMP training.

    ampkernels.layer_norm(x, normalized_shape, weight, bias, eps, *, residual=None, ...)
    ampkernels.rms_norm(x, normalized_shape, weight, eps, *, residual=None, ...)
    ampkernels.linear_act(x, weight, bias=None, activation="gelu_tanh", *, backend=None)
    ampkernels.gated_linear_act(x, gate_weight, up_weight, gate_bias=None, up_bias=None, activation="silu", ...)
    ampkernels.linear_cross_entropy(x, weight, target, bias=None, *, ignore_index=-100, ...)
    ampkernels.rotary_embedding(q, k, cos, sin, unsqueeze_dim=1, *, out_dtype=None, backend=None)
    ampkernels.available_backends()
    ampkernels.nn.LayerNorm / RMSNorm / Linear / FusedMLP / FusedGatedMLP / LinearCrossEntropy / convert

Backends: "cuda" (compiled extension), "triton", "torch" (reference); "auto" by default,
overridable per call, per module and with AMPKERNELS_BACKEND.
"""
from .backends import available_backends
from .ops.bias_act import bias_act
from .ops.gated_linear_act import gated_linear_act
from .ops.layer_norm import layer_norm, rms_norm
from .ops.linear_act import linear_act
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops.rotary import rotary_embedding
from .reference import ACTIVATIONS

__version__ = "0.1.0"
__all__ = ["layer_norm", "rms_norm", "linear_act", "gated_linear_act", "linear_cross_entropy", "rotary_embedding",
           "bias_act", "available_backends", "ACTIVATIONS"]
