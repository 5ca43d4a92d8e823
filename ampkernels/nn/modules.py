"""Modules that are the torch module they replace: same constructor, parameters,
state_dict keys and repr; only forward changes. Inputs the kernels do not take (CPU,
float64, ...) run the torch reference path inside the ops, unnoticed by the caller.

`backend` (None = "auto" / AMPKERNELS_BACKEND) is a plain attribute, not state.

Norms also take `out_dtype`: None keeps the input dtype (the op's contract); a dtype
forces one; "autocast" gives the autocast dtype while autocast is on (else the input
dtype) -- for an fp32 residual stream whose norm output only feeds matmuls, which would
cast it anyway: the norm then writes half the bytes and the cast kernel disappears.
"""
import torch

from .. import reference
from ..ops import layer_norm as _ln
from ..ops.layer_norm import layer_norm, rms_norm
from ..ops.gated_linear_act import ACTIVATIONS as GATED_ACTIVATIONS
from ..ops.gated_linear_act import gated_linear_act, gated_mlp
from ..ops.linear_act import linear_act
from ..ops.linear_cross_entropy import REDUCTIONS, linear_cross_entropy
from ..ops.mlp import fused_mlp


def _resolve_out_dtype(out_dtype, x):
    if out_dtype is None:
        return None
    if out_dtype == "autocast":
        device = x.device.type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) and x.is_floating_point() \
            else None
    if not isinstance(out_dtype, torch.dtype):
        raise ValueError(f"out_dtype must be None, a torch.dtype or 'autocast', got {out_dtype!r}")
    return out_dtype


def _norm_entry(*args):
    # the first call binds the extension's entry (or a stand-in that declines) in its place
    global _norm_entry
    _norm_entry = _ln.module_entry()
    return _norm_entry(*args)


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm whose output keeps the input dtype under autocast (fp32 math inside)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None, *,
                 backend=None, out_dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.backend, self.out_dtype = backend, out_dtype

    def forward(self, x):
        # the plain eager call straight to the op (ops/layer_norm.py module_entry), else in full
        out = NotImplemented if torch.compiler.is_compiling() else _norm_entry(
            x, self.weight, self.bias, self.eps, False, self.out_dtype, self.backend, _ln._HOST_BOUND_ELEMENTS)
        if out is NotImplemented:
            out = layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps,
                             out_dtype=_resolve_out_dtype(self.out_dtype, x), backend=self.backend)
        return out

    def forward_residual(self, x, residual):
        """(self(residual + x), residual + x) with the add inside the norm's op (see _residual_call)."""
        return _residual_call(self, x, residual, self.weight, self.bias, False)


def _residual_call(norm, x, residual, weight, bias, is_rms):
    """The pre-norm step `s = residual + x; return norm(s), s`. Where torch's add gives an fp32 sum
    (a 16-bit x on the fp32 stream of autocast training, or all fp32) as one norm op with a
    residual: the sum exactly as torch's add rounds it, normalised, the output in the module's
    out_dtype (else fp32, as the module gives its input's dtype). Any other sum (16-bit, which
    the op would normalise before its rounding; float64) takes the add and the module."""
    if not isinstance(residual, torch.Tensor) or not isinstance(x, torch.Tensor):
        raise TypeError(f"forward_residual: x and residual must be Tensors, got {type(x).__name__} and "
                        f"{type(residual).__name__}")
    if torch.promote_types(residual.dtype, x.dtype) != torch.float32:
        s = residual + x
        return norm(s), s
    out_dtype = _resolve_out_dtype(norm.out_dtype, x) or torch.float32
    out = NotImplemented if torch.compiler.is_compiling() else _norm_entry(
        x, weight, bias, norm.eps, is_rms, out_dtype, norm.backend, _ln._HOST_BOUND_ELEMENTS, residual, True)
    if out is NotImplemented:
        op = rms_norm if is_rms else layer_norm
        args = (weight,) if is_rms else (weight, bias)
        out = op(x, norm.normalized_shape, *args, norm.eps, residual=residual, residual_in_fp32=True,
                 out_dtype=out_dtype, backend=norm.backend)
    return out


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm whose output keeps the input dtype under autocast (fp32 math inside)."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None, *, backend=None,
                 out_dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.backend, self.out_dtype = backend, out_dtype

    def forward(self, x):
        return self._forward(x, self.weight)

    def _forward(self, x, weight):
        out = NotImplemented if torch.compiler.is_compiling() else _norm_entry(
            x, weight, None, self.eps, True, self.out_dtype, self.backend, _ln._HOST_BOUND_ELEMENTS)
        if out is NotImplemented:
            out = rms_norm(x, self.normalized_shape, weight, self.eps, out_dtype=_resolve_out_dtype(self.out_dtype, x),
                           backend=self.backend)
        return out

    def forward_residual(self, x, residual):
        """(self(residual + x), residual + x) with the add inside the norm's op (see _residual_call)."""
        return self._forward_residual(x, residual, self.weight)

    def _forward_residual(self, x, residual, weight):
        return _residual_call(self, x, residual, weight, None, True)


class OffsetRMSNorm(RMSNorm):
    """RMSNorm whose scale is (offset + weight), the stored weight raw: Gemma's RMSNorm
    (normalize(x) * (1 + weight), weight initialised to zeros). The Parameter and its
    state_dict key are the original module's; offset + weight is formed in fp32 on each call
    (one (H,) op), as Gemma computes it, so a bf16 weight loses nothing to the +1."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None, *, offset=1.0,
                 backend=None, out_dtype=None):
        self.offset = float(offset)
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype, backend=backend,
                         out_dtype=out_dtype)

    def reset_parameters(self):
        if self.elementwise_affine:
            torch.nn.init.constant_(self.weight, 1.0 - self.offset)  # a scale of one, as RMSNorm's

    def forward(self, x):
        return self._forward(x, self._scale())

    def forward_residual(self, x, residual):
        return self._forward_residual(x, residual, self._scale())

    def _scale(self):
        return None if self.weight is None else self.weight.float() + self.offset

    def extra_repr(self):
        return super().extra_repr() + f", offset={self.offset}"


class Linear(torch.nn.Linear):
    """torch.nn.Linear followed by a fused activation: act(x @ weight.T + bias).

    activation: one of ampkernels.ACTIVATIONS ("identity" makes it a plain Linear).
    """

    def __init__(self, in_features, out_features, bias=True, activation="identity", device=None, dtype=None, *,
                 backend=None):
        reference.activation_id(activation)
        super().__init__(in_features, out_features, bias, device, dtype)
        self.activation = activation
        self.backend = backend

    def forward(self, x):
        return linear_act(x, self.weight, self.bias, self.activation, backend=self.backend)

    def extra_repr(self):
        return super().extra_repr() + f", activation={self.activation!r}"


class LinearCrossEntropy(torch.nn.Linear):
    """An LM head and its loss in one: forward(x, target) = cross_entropy(x @ weight.T + bias,
    target) without the (tokens, vocab) logits (ampkernels.linear_cross_entropy). Holds the
    head's weight (out_features = vocab) and bias as nn.Linear does, same state_dict."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, ignore_index=-100,
                 label_smoothing=0.0, reduction="mean", backend=None):
        if reduction not in REDUCTIONS:
            raise ValueError(f"LinearCrossEntropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        super().__init__(in_features, out_features, bias, device, dtype)
        self.ignore_index, self.label_smoothing, self.reduction = ignore_index, label_smoothing, reduction
        self.backend = backend

    def forward(self, x, target):
        return linear_cross_entropy(x, self.weight, target, self.bias, ignore_index=self.ignore_index,
                                    label_smoothing=self.label_smoothing, reduction=self.reduction,
                                    backend=self.backend)

    def extra_repr(self):
        return (super().extra_repr() + f", ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}"
                f", reduction={self.reduction!r}")


class FusedResidualBlocks(torch.nn.Sequential):
    """The nn.Sequential of pre-norm transformer blocks it replaces (timm's VisionTransformer
    `blocks`: same children, state_dict keys and modules), run with each residual add inside
    the next block's norm. A block is timm's Block, whose forward is

        x = x + drop_path1(ls1(attn(norm1(x))));  x = x + drop_path2(ls2(mlp(norm2(x))))

    here run as: h, x = norm.forward_residual(branch, x) for every norm after the first, the
    last add left to the end. On an fp32 stream (autocast training) each add then costs no
    kernel of its own (nor, in backward, the gradient's accumulation into the stream), and the
    sum is the one torch's add makes; a 16-bit stream keeps its adds (see
    ampkernels.nn.LayerNorm.forward_residual). Every block's norm1 and norm2 must have
    forward_residual (ampkernels' norms): convert() installs this only then, and only after the
    probe shows it equal to the blocks run one by one. Iterating it (gradient checkpointing,
    per-block masks) runs the blocks themselves, unfused."""

    def forward(self, x):
        residual, branch = x, None
        for block in self:
            if branch is None:
                h = block.norm1(residual)
            else:
                h, residual = block.norm1.forward_residual(branch, residual)
            branch = block.drop_path1(block.ls1(block.attn(h)))
            h, residual = block.norm2.forward_residual(branch, residual)
            branch = block.drop_path2(block.ls2(block.mlp(h)))
        return residual if branch is None else residual + branch


class FusedPostNormResidual(torch.nn.Module):
    """A post-norm transformer's output sublayer, Hugging Face BERT's BertSelfOutput / BertOutput
    (and their copies, RoBERTa's, ELECTRA's, ...): LayerNorm(dropout(dense(hidden_states)) +
    input_tensor), with the add inside the norm's op on an fp32 stream
    (LayerNorm.forward_residual: the sum as torch's add makes it; in backward no add node). Its
    children are the original's (dense, LayerNorm, dropout), so state_dict keys are unchanged;
    convert() installs it only after the probe shows it equal."""

    def __init__(self, dense, layer_norm, dropout):
        super().__init__()
        self.dense, self.LayerNorm, self.dropout = dense, layer_norm, dropout

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm.forward_residual(self.dropout(self.dense(hidden_states)), input_tensor)[0]


_ACTIVATION_MODULES = {
    "identity": torch.nn.Identity, "relu": torch.nn.ReLU, "gelu": torch.nn.GELU,
    "gelu_tanh": lambda: torch.nn.GELU(approximate="tanh"), "silu": torch.nn.SiLU,
}


class _SquaredReLU(torch.nn.Module):
    def forward(self, x):
        return reference.act_fwd(x, "squared_relu")


class FusedMLP(torch.nn.Sequential):
    """Linear(in, hidden) -> activation -> Linear(hidden, out), fused.

    It is the nn.Sequential it replaces: children 0, 1, 2 and state_dict keys
    0.weight, 0.bias, 2.weight, 2.bias, so checkpoints load both ways.

    Saved for backward: the input, the weights and ONE hidden-sized tensor (the
    pre-activation, in the compute dtype). The eager block keeps two (pre- and
    post-activation); here the post-activation is recomputed from the pre-activation in
    backward (one elementwise pass), which is what makes the memory saving.
    """

    def __init__(self, in_features, hidden_features, out_features=None, activation="gelu_tanh", bias=True,
                 device=None, dtype=None, *, backend=None):
        reference.activation_id(activation)
        out_features = in_features if out_features is None else out_features
        act = _ACTIVATION_MODULES.get(activation, _SquaredReLU)()
        super().__init__(torch.nn.Linear(in_features, hidden_features, bias, device, dtype), act,
                         torch.nn.Linear(hidden_features, out_features, bias, device, dtype))
        self.activation = activation
        self.backend = backend

    def forward(self, x):
        fc1, fc2 = self[0], self[2]
        return fused_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, self.activation, backend=self.backend)


def _check_gated_activation(activation):
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")


class FusedGatedMLP(torch.nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)): the gated MLP of LLaMA, Mistral, Qwen2/3
    (activation "silu", SwiGLU) and Gemma ("gelu_tanh", GeGLU), with Hugging Face LlamaMLP's
    children and state_dict keys (gate_proj, up_proj, down_proj: nn.Linear), so checkpoints load
    both ways.

    Forward: the gate and up projections in one fused GEMM with the gated epilogue
    (ampkernels.gated_linear_act), then down_proj. Saved for backward in eager training on the
    kernels: x, the weights and ONE buffer of g and u (2 x hidden per token); h, down_proj's
    input, is recomputed from it. The eager block keeps g, u, act(g) and h (4 x hidden).
    """

    def __init__(self, in_features, hidden_features, out_features=None, activation="silu", bias=False, device=None,
                 dtype=None, *, backend=None):
        super().__init__()
        _check_gated_activation(activation)
        out_features = in_features if out_features is None else out_features
        self.gate_proj = torch.nn.Linear(in_features, hidden_features, bias, device, dtype)
        self.up_proj = torch.nn.Linear(in_features, hidden_features, bias, device, dtype)
        self.down_proj = torch.nn.Linear(hidden_features, out_features, bias, device, dtype)
        self.activation, self.backend = activation, backend

    def forward(self, x):
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        return gated_mlp(x, g.weight, u.weight, g.bias, u.bias, d.weight, d.bias, self.activation, backend=self.backend)

    def extra_repr(self):
        return f"activation={self.activation!r}"


class FusedSwiGLU(torch.nn.Module):
    """timm's SwiGLU block (fc1_g, fc1_x, fc2, drop2; its state_dict keys) with an identity norm and
    no dropout before fc2: drop2(fc2(act(fc1_g(x)) * fc1_x(x))), fused as FusedGatedMLP.
    convert() builds it from timm's module, sharing its children."""

    def __init__(self, fc1_g, fc1_x, fc2, drop2=None, activation="silu", *, backend=None):
        super().__init__()
        _check_gated_activation(activation)
        self.fc1_g, self.fc1_x, self.fc2 = fc1_g, fc1_x, fc2
        self.drop2 = torch.nn.Identity() if drop2 is None else drop2
        self.activation, self.backend = activation, backend

    def forward(self, x):
        g, u, d = self.fc1_g, self.fc1_x, self.fc2
        return self.drop2(gated_mlp(x, g.weight, u.weight, g.bias, u.bias, d.weight, d.bias, self.activation,
                                    backend=self.backend))

    def extra_repr(self):
        return f"activation={self.activation!r}"


class FusedT5GatedDense(torch.nn.Module):
    """Hugging Face's T5DenseGatedActDense (T5 v1.1, flan-T5, mT5, UMT5: wi_0, wi_1, wo, dropout,
    act; its state_dict keys): wo(dropout(act(wi_0(x)) * wi_1(x))), the gated part as one fused
    GEMM (ampkernels.gated_linear_act). The dropout and T5's cast of h to wo's dtype (wo kept in
    fp32) stay where T5 has them. convert() builds it from T5's module, sharing its children."""

    def __init__(self, wi_0, wi_1, wo, dropout, activation="gelu_tanh", *, backend=None):
        super().__init__()
        _check_gated_activation(activation)
        self.wi_0, self.wi_1, self.wo, self.dropout = wi_0, wi_1, wo, dropout
        self.activation, self.backend = activation, backend

    def forward(self, x):
        h = self.dropout(gated_linear_act(x, self.wi_0.weight, self.wi_1.weight, self.wi_0.bias, self.wi_1.bias,
                                          self.activation, backend=self.backend))
        w = self.wo.weight
        if isinstance(w, torch.Tensor) and h.dtype != w.dtype and w.dtype != torch.int8:
            h = h.to(w.dtype)  # as T5 does
        return self.wo(h)

    def extra_repr(self):
        return f"activation={self.activation!r}"


class FusedPackedGatedMLP(torch.nn.Module):
    """down_proj(act(g) * u) with [g | u] = gate_up_proj(x): the gated MLP of Phi-3 / Phi-4 and GLM,
    with their children and state_dict keys (gate_up_proj with 2 x hidden outputs, gate first;
    down_proj). g and u are the halves of gate_up_proj's one weight, adjacent in memory: the cuda
    backend runs them as one GEMM (as FusedGatedMLP with packed weights). convert() builds it from
    such a module, sharing its children."""

    def __init__(self, gate_up_proj, down_proj, activation="silu", *, backend=None):
        super().__init__()
        _check_gated_activation(activation)
        if gate_up_proj.out_features % 2:
            raise ValueError(f"gate_up_proj must have an even number of outputs, got {gate_up_proj.out_features}")
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.activation, self.backend = activation, backend

    def forward(self, x):
        gu, d = self.gate_up_proj, self.down_proj
        w, b = gu.weight.chunk(2, 0), (None, None) if gu.bias is None else gu.bias.chunk(2, 0)
        return gated_mlp(x, w[0], w[1], b[0], b[1], d.weight, d.bias, self.activation, backend=self.backend)

    def extra_repr(self):
        return f"activation={self.activation!r}"


class FusedGluMlp(torch.nn.Module):
    """timm's GluMlp (fc1 with 2 x hidden outputs, chunked in two; fc2; drop2; its state_dict keys)
    with an identity norm and no dropout before fc2. gate_last: the gate is fc1's second half
    (timm's flag). Gate and up are views of fc1's one weight: with the gate first they are
    adjacent in memory and the cuda backend runs them as ONE GEMM."""

    def __init__(self, fc1, fc2, drop2=None, activation="silu", gate_last=True, *, backend=None):
        super().__init__()
        _check_gated_activation(activation)
        if fc1.out_features % 2:
            raise ValueError(f"fc1 must have an even number of outputs, got {fc1.out_features}")
        self.fc1, self.fc2 = fc1, fc2
        self.drop2 = torch.nn.Identity() if drop2 is None else drop2
        self.activation, self.gate_last, self.backend = activation, gate_last, backend

    def forward(self, x):
        w, b = self.fc1.weight.chunk(2, 0), (None, None) if self.fc1.bias is None else self.fc1.bias.chunk(2, 0)
        gate, up = (1, 0) if self.gate_last else (0, 1)
        d = self.fc2
        return self.drop2(gated_mlp(x, w[gate], w[up], b[gate], b[up], d.weight, d.bias, self.activation,
                                    backend=self.backend))

    def extra_repr(self):
        return f"activation={self.activation!r}, gate_last={self.gate_last}"
