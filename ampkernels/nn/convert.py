"""convert(model): swap what ampkernels can provably replace, in place, sharing parameters.

Recognised (anything else is left untouched):
- torch.nn.LayerNorm / torch.nn.RMSNorm (exact classes) -> ampkernels.nn.LayerNorm / RMSNorm;
  Hugging Face LlamaRMSNorm-style modules (weight + variance_epsilon) -> RMSNorm.
- In an nn.Sequential: a torch.nn.Linear directly followed by a known activation module
  -> ampkernels.nn.Linear(activation=...) and the activation slot -> nn.Identity.
- Hugging Face MLPs whose forward applies the activation straight to one projection:
  BertIntermediate (dense -> intermediate_act_fn), BertPredictionHeadTransform, GPT2MLP (c_fc -> act; Conv1D weights are
  used transposed, no copy), LLaMA-style MLPs (gate_proj -> act_fn). The projection
  becomes fused and the activation attribute becomes nn.Identity.
New modules reuse the existing Parameter objects: optimizers, tied weights and state_dict
keys keep working. Returns (model, ConvertReport).
"""
import dataclasses

import torch

from ..ops.linear_act import linear_act
from .modules import LayerNorm, Linear, RMSNorm


def activation_name(module):
    """The ampkernels activation equivalent to `module`, or None if not provably equal."""
    t = type(module)
    if t is torch.nn.ReLU:
        return "relu"
    if t is torch.nn.SiLU:
        return "silu"
    if t is torch.nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    # Hugging Face transformers.activations, matched by class name so transformers stays optional
    hf = {"GELUActivation": "gelu", "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh",
          "PytorchGELUTanh": "gelu_tanh", "GELUPytorchTanh": "gelu_tanh", "FastGELUActivation": "gelu_tanh",
          "SiLUActivation": "silu", "ReLUSquaredActivation": "squared_relu"}
    name = hf.get(t.__name__)
    if name and t.__module__.startswith("transformers."):
        if t.__name__ == "GELUActivation" and getattr(module, "act", torch.nn.functional.gelu) is not \
                torch.nn.functional.gelu:
            return None  # GELUActivation(use_gelu_python=True) is the erf GELU too, but stay strict
        return name
    return None


class Conv1DAct(torch.nn.Module):
    """transformers' Conv1D (weight (in, out), y = x @ W + b) with a fused activation.
    Same parameters and state_dict keys as the Conv1D it replaces."""

    def __init__(self, conv1d, activation, backend=None):
        super().__init__()
        self.nf = conv1d.nf
        self.weight, self.bias = conv1d.weight, conv1d.bias
        self.activation, self.backend = activation, backend

    def forward(self, x):
        return linear_act(x, self.weight.t(), self.bias, self.activation, backend=self.backend)

    def extra_repr(self):
        return f"in={self.weight.shape[0]}, out={self.nf}, activation={self.activation!r}"


def _qualified_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclasses.dataclass
class Replacement:
    path: str            # the module's qualified name in the model
    old: str             # module-qualified class names: torch's LayerNorm and ours share a short name
    new: str
    activation: object   # the activation fused into the new module, or None


@dataclasses.dataclass
class ConvertReport:
    replaced: list = dataclasses.field(default_factory=list)  # (path, old class, new class), short names
    details: list = dataclasses.field(default_factory=list)   # Replacement per entry of `replaced`

    def add(self, path, old, new):
        self.replaced.append((path, type(old).__name__, type(new).__name__))
        self.details.append(Replacement(path, _qualified_name(type(old)), _qualified_name(type(new)),
                                        getattr(new, "activation", None)))

    def sort(self, order):
        """Put the entries in model order: `order` maps a module path to its position."""
        ranks = [order.get(d.path, len(order)) for d in self.details]
        keep = sorted(range(len(ranks)), key=ranks.__getitem__)
        self.replaced = [self.replaced[i] for i in keep]
        self.details = [self.details[i] for i in keep]

    def __str__(self):
        if not self.replaced:
            return "ampkernels.nn.convert: nothing recognised; model unchanged"
        lines = [f"ampkernels.nn.convert: {len(self.replaced)} module(s) replaced"]
        for d in self.details:
            fused = f" (fused activation: {d.activation})" if d.activation else ""
            lines.append(f"  {d.path}: {d.old} -> {d.new}{fused}")
        return "\n".join(lines)


def _new_layer_norm(old, backend, out_dtype):
    new = LayerNorm(old.normalized_shape, old.eps, old.elementwise_affine, old.bias is not None, device="meta",
                    backend=backend, out_dtype=out_dtype)
    new.weight, new.bias = old.weight, old.bias
    return new


def _new_rms_norm(old, backend, out_dtype):
    eps = getattr(old, "eps", None)
    if eps is None and hasattr(old, "variance_epsilon"):
        eps = old.variance_epsilon
    shape = getattr(old, "normalized_shape", None) or tuple(old.weight.shape)
    new = RMSNorm(shape, eps, True, device="meta", backend=backend, out_dtype=out_dtype)
    new.weight = old.weight
    return new


def _new_linear(old, activation, backend):
    new = Linear(old.in_features, old.out_features, old.bias is not None, activation, device="meta", backend=backend)
    new.weight, new.bias = old.weight, old.bias
    return new


def _is_hf_rms_norm(m):
    # LlamaRMSNorm and its copies (Mistral, Qwen2, ...): weight * normalize(x) with variance_epsilon
    return type(m).__name__.endswith("RMSNorm") and type(m).__module__.startswith("transformers.") and \
        hasattr(m, "variance_epsilon") and isinstance(getattr(m, "weight", None), torch.nn.Parameter) and \
        len(list(m.children())) == 0


# Hugging Face MLP classes: (class name, projection attribute, activation attribute)
_HF_MLPS = (
    ("BertIntermediate", "dense", "intermediate_act_fn"),
    ("RobertaIntermediate", "dense", "intermediate_act_fn"),
    ("BertPredictionHeadTransform", "dense", "transform_act_fn"),
    ("GPT2MLP", "c_fc", "act"),
    ("LlamaMLP", "gate_proj", "act_fn"),
    ("MistralMLP", "gate_proj", "act_fn"),
    ("Qwen2MLP", "gate_proj", "act_fn"),
)


def _fuse_projection(proj, act, backend):
    activation = activation_name(act)
    if activation is None:
        return None
    if type(proj) is torch.nn.Linear:
        return _new_linear(proj, activation, backend)
    if type(proj).__name__ == "Conv1D" and type(proj).__module__.startswith("transformers."):
        return Conv1DAct(proj, activation, backend)
    return None


def convert(model, *, norms=True, linears=True, backend=None, norm_out_dtype=None, verbose=False):
    """Swap recognised norms and Linear->activation pairs in `model` (in place).

    norms / linears: restrict what is converted. backend: stored on every new module
    (None = "auto"). norm_out_dtype: the new norms' out_dtype (see ampkernels.nn.LayerNorm;
    "autocast" suits transformers whose norm outputs only feed matmuls). Returns
    (model, ConvertReport). A model with nothing recognised is returned unchanged.
    """
    if backend is not None:
        from ..backends import requested
        requested(backend)  # validate the name now, not at the first forward
    report = ConvertReport()
    # the report lists modules in model order; the walk below meets a parent's norms before its children
    model_order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    if norms and type(model) in (torch.nn.LayerNorm, torch.nn.RMSNorm):
        raise ValueError("convert() swaps submodules; wrap a bare norm in a container or use ampkernels.nn directly")
    for path, parent in list(model.named_modules()):
        prefix = f"{path}." if path else ""
        if linears and isinstance(parent, torch.nn.Sequential) and type(parent) is torch.nn.Sequential:
            names = list(parent._modules)
            for a, b in zip(names, names[1:]):
                lin, act = parent._modules[a], parent._modules[b]
                activation = activation_name(act)
                if type(lin) is torch.nn.Linear and activation is not None:
                    new = _new_linear(lin, activation, backend)
                    parent._modules[a], parent._modules[b] = new, torch.nn.Identity()
                    report.add(prefix + a, lin, new)
        mlp = next((m for m in _HF_MLPS if type(parent).__name__ == m[0]), None)
        if linears and mlp and type(parent).__module__.startswith("transformers."):
            proj, act = getattr(parent, mlp[1]), getattr(parent, mlp[2])
            new = _fuse_projection(proj, act, backend)
            if new is not None:
                setattr(parent, mlp[1], new)
                setattr(parent, mlp[2], torch.nn.Identity())
                report.add(prefix + mlp[1], proj, new)
        if norms:
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.LayerNorm:
                    new = _new_layer_norm(child, backend, norm_out_dtype)
                elif type(child) is torch.nn.RMSNorm or _is_hf_rms_norm(child):
                    new = _new_rms_norm(child, backend, norm_out_dtype)
                else:
                    continue
                setattr(parent, name, new)
                report.add(prefix + name, child, new)
    report.sort(model_order)
    if verbose:
        print(report)
    return model, report


__all__ = ["convert", "ConvertReport", "Replacement", "Conv1DAct", "activation_name"]
