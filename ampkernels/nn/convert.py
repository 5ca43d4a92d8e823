"""convert(model): swap what ampkernels can provably replace, in place, sharing parameters.

Recognised (anything else is left untouched):
- Norms: torch.nn.LayerNorm / torch.nn.RMSNorm and their subclasses (timm's LayerNorm,
  LayerNormFp32, ...) -> ampkernels.nn.LayerNorm / RMSNorm; Hugging Face LlamaRMSNorm-style
  modules (weight + variance_epsilon), T5LayerNorm and its copies, and timm's RmsNorm /
  RmsNormFp32 -> RMSNorm; Gemma's RMSNorm (normalize(x) * (1 + weight), eps) -> OffsetRMSNorm,
  which keeps the raw weight as its Parameter.
- In an nn.Sequential: a torch.nn.Linear directly followed by a known activation module
  -> ampkernels.nn.Linear(activation=...) and the activation slot -> nn.Identity.
- Hugging Face MLPs whose forward applies the activation straight to one projection:
  BertIntermediate (dense -> intermediate_act_fn), BertPredictionHeadTransform, GPT2MLP (c_fc -> act; Conv1D weights are
  used transposed, no copy). The projection becomes fused and the activation attribute becomes nn.Identity.
- Hugging Face MLPs without a gate (T5DenseActDense and its copies, GPT-NeoX, Falcon, Phi,
  CodeGen, GPT-J, GPT-Neo; _HF_PLAIN_MLPS): projection (nn.Linear, a subclass such as FalconLinear,
  or Conv1D) + activation fused once the probe shows the whole MLP unchanged; an activation with
  no fused equivalent (BLOOM's BloomGelu, a Tanh) is reported. Other Hugging Face modules with an
  nn.Linear fc1 and a known activation_fn (ViT and SigLIP MLPs), an nn.Linear dense and a known
  intermediate_act_fn (BertIntermediate's copies) or an nn.Linear c_fc and a known act (Starcoder2,
  GPT-BigCode), and no other children, are fused the same way, probed. In an nn.Sequential, a
  Dropout between a Linear and its activation is reported (not fused).
- timm's Mlp and subclasses (fc1 -> act -> drop1 -> norm -> fc2): fc1 + act -> ampkernels.nn.Linear(activation=...),
  act -> nn.Identity (drop1 and norm come after the activation and stay as they are).
- Gated MLPs (SwiGLU / GeGLU), whole: LLaMA-style MLPs (recognised by structure: exactly
  gate_proj, up_proj, down_proj nn.Linears and an act_fn of SiLU / GELU / tanh GELU, as Hugging Face's
  LlamaMLP, MistralMLP, Qwen2MLP, Qwen3MLP, GemmaMLP, ...) -> ampkernels.nn.FusedGatedMLP; timm's
  SwiGLU -> FusedSwiGLU and GluMlp -> FusedGluMlp (identity norm and p=0 dropout before fc2 only); Hugging
  Face's T5DenseGatedActDense (T5 v1.1, flan-T5, mT5) -> FusedT5GatedDense (its dropout and wo stay as they are);
  a packed gate_up_proj + down_proj + activation_fn (Phi-3, GLM) -> FusedPackedGatedMLP.
  Each keeps the original's children, so state_dict keys are unchanged; each swap is probed.
- Residual adds: an nn.Sequential of timm's ViT Blocks whose norms were all swapped ->
  ampkernels.nn.FusedResidualBlocks (the same children; each add inside the next norm), probed;
  Hugging Face's post-norm output sublayers (BertSelfOutput / BertOutput and their copies: dense,
  LayerNorm, dropout; LayerNorm(dropout(dense(h)) + input_tensor)) -> FusedPostNormResidual, probed.

The probe: a norm, a timm Mlp or a gated MLP is only swapped after a copy of it (fp32, random parameters,
on its own device) and the swapped copy give the same output (1e-5 of the output's largest
magnitude) on random fp32 inputs, the RNG replayed for each so that dropout draws the same
mask. The class name alone is never trusted: a subclass whose forward computes something
else fails the probe and is left alone. Modules with hooks (which a swap would drop) are
left alone too. Exact torch.nn.LayerNorm / RMSNorm are probed as well; on the meta device,
where nothing can run, only norms with torch's own forward (equal by construction) are swapped.

New modules reuse the existing Parameter objects: optimizers, tied weights and state_dict
keys keep working. Returns (model, ConvertReport): what was replaced, and what was
recognised but left alone, with the reason (`report.skipped`).
"""
import copy
import dataclasses

import torch

from ..ops.gated_linear_act import ACTIVATIONS as GATED_ACTIVATIONS
from ..ops.linear_act import linear_act
from .modules import (FusedGatedMLP, FusedGluMlp, FusedPackedGatedMLP, FusedPostNormResidual, FusedResidualBlocks,
                      FusedSwiGLU, FusedT5GatedDense, LayerNorm, Linear, OffsetRMSNorm, RMSNorm)


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
    # timm.layers.activations (what timm's get_act_layer("gelu") gives): forward is F.gelu(x[, approximate])
    if t.__module__ == "timm.layers.activations":
        return {"GELU": "gelu", "GELUTanh": "gelu_tanh"}.get(t.__name__)
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
class Skipped:
    path: str            # the module's qualified name in the model
    cls: str             # its module-qualified class name
    reason: str          # why convert left it alone


@dataclasses.dataclass
class ConvertReport:
    replaced: list = dataclasses.field(default_factory=list)  # (path, old class, new class), short names
    details: list = dataclasses.field(default_factory=list)   # Replacement per entry of `replaced`
    skipped: list = dataclasses.field(default_factory=list)   # Skipped: recognised, left alone
    fused_loss: bool = False  # integrations.transformers.apply fused the LM head and loss
    fused_rotary: int = 0     # attention modules whose rotary embedding runs fused (integrations.rotary)

    def add(self, path, old, new):
        self.replaced.append((path, type(old).__name__, type(new).__name__))
        self.details.append(Replacement(path, _qualified_name(type(old)), _qualified_name(type(new)),
                                        getattr(new, "activation", None)))

    def skip(self, path, module, reason):
        self.skipped.append(Skipped(path, _qualified_name(type(module)), reason))

    def sort(self, order):
        """Put the entries in model order: `order` maps a module path to its position."""
        ranks = [order.get(d.path, len(order)) for d in self.details]
        keep = sorted(range(len(ranks)), key=ranks.__getitem__)
        self.replaced = [self.replaced[i] for i in keep]
        self.details = [self.details[i] for i in keep]
        self.skipped.sort(key=lambda k: order.get(k.path, len(order)))

    def __str__(self):
        if not self.replaced and not self.skipped and not self.fused_loss and not self.fused_rotary:
            return "ampkernels.nn.convert: nothing recognised; model unchanged"
        if self.replaced:
            lines = [f"ampkernels.nn.convert: {len(self.replaced)} module(s) replaced"]
        else:
            unchanged = "" if self.fused_loss or self.fused_rotary else "; model unchanged"
            lines = [f"ampkernels.nn.convert: nothing replaced{unchanged}"]
        for d in self.details:
            fused = f" (fused activation: {d.activation})" if d.activation else ""
            lines.append(f"  {d.path}: {d.old} -> {d.new}{fused}")
        if self.fused_loss:
            lines.append("  (model): LM head + loss fused (ampkernels.linear_cross_entropy, no logits in training)")
        if self.fused_rotary:
            lines.append(f"  (model): rotary embedding fused in {self.fused_rotary} attention module(s) "
                         "(ampkernels.rotary_embedding)")
        if self.skipped:
            lines.append(f"ampkernels.nn.convert: {len(self.skipped)} module(s) recognised but left alone")
            lines += [f"  {k.path or '(model)'}: {k.cls} ({k.reason})" for k in self.skipped]
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
    new = RMSNorm(shape, eps, old.weight is not None, device="meta", backend=backend, out_dtype=out_dtype)
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


def _is_timm_rms_norm(m):
    # timm.layers.RmsNorm / RmsNormFp32: x * rsqrt(mean(x^2) + eps) [* weight], computed in fp32 by the second
    return type(m).__module__.startswith("timm.") and type(m).__name__ in ("RmsNorm", "RmsNormFp32") and \
        hasattr(m, "eps") and hasattr(m, "normalized_shape") and len(list(m.children())) == 0


def _new_offset_rms_norm(old, backend, out_dtype):
    new = OffsetRMSNorm(tuple(old.weight.shape), _norm_eps(old), device="meta", backend=backend, out_dtype=out_dtype)
    new.weight = old.weight
    return new


def _norm_eps(m):
    eps = getattr(m, "eps", None)
    return m.variance_epsilon if eps is None and hasattr(m, "variance_epsilon") else eps


def _is_hf_weight_only_norm(m, suffixes, eps_attr):
    return type(m).__module__.startswith("transformers.") and type(m).__name__.endswith(suffixes) and \
        isinstance(getattr(m, eps_attr, None), float) and isinstance(getattr(m, "weight", None), torch.nn.Parameter) \
        and m.weight.dim() == 1 and getattr(m, "bias", None) is None and len(list(m.children())) == 0


def _hf_norm_builders(m):
    """Candidate builders for Hugging Face weight-only norms the probe then decides between:
    T5LayerNorm and its copies (RMS without mean, fp32 variance, variance_epsilon) -> RMSNorm;
    RMSNorms with an `eps` attribute: Gemma's (normalize(x) * (1 + weight)) -> OffsetRMSNorm,
    or a plain one -> RMSNorm."""
    if _is_hf_weight_only_norm(m, ("LayerNorm",), "variance_epsilon"):
        return (_new_rms_norm,)
    if _is_hf_weight_only_norm(m, ("RMSNorm",), "eps") and not hasattr(m, "variance_epsilon"):
        return (_new_rms_norm, _new_offset_rms_norm)
    return ()


def _norm_builders(m):
    """How to build the ampkernels norm for `m`: candidates in the order the probe tries them, () if none."""
    if isinstance(m, (LayerNorm, RMSNorm)):
        return ()  # converted already
    if isinstance(m, torch.nn.LayerNorm):
        return (_new_layer_norm,)
    if isinstance(m, torch.nn.RMSNorm) or _is_hf_rms_norm(m) or _is_timm_rms_norm(m):
        return (_new_rms_norm,)
    return _hf_norm_builders(m)


def _norm_builder(m):
    """How to build the ampkernels norm for `m`, or None if `m` is no norm convert knows."""
    return next(iter(_norm_builders(m)), None)


def _hooked(*modules):
    """Why swapping these modules would change behaviour the class does not show, or None."""
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return f"{type(m).__name__} has hooks, which a swap would drop"
        if "forward" in vars(m):
            return f"{type(m).__name__}.forward is patched on the instance"
    return None


# ------------------------------------------------------------------ the probe

PROBE_RTOL = 1e-5  # of the output's largest magnitude: fp32 rounding is ~1e-7, any real difference far more


def _rng_replay(device):
    """A function that puts the RNG of the CPU and of `device` back where it is now."""
    cpu = torch.get_rng_state()
    dev = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore():
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.cuda.set_rng_state(dev, device)
    return restore


def _probe_inputs(feature_shapes, gen):
    """Two calls' arguments, one (2, 5, *shape) tensor per shape: unit scale, then a small spread
    on an offset (an eps or a centring that differs shows in the second)."""
    zs = [torch.randn((2, 5, *shape), generator=gen) for shape in feature_shapes]
    return [zs, [0.5 + 0.01 * z for z in zs]]


def probe(module, swap, feature_shape, *, rtol=PROBE_RTOL, more_inputs=()):
    """None if `swap` leaves what `module` computes unchanged, else the reason it does not (or cannot be shown).

    Runs on copies: `module` copied to fp32 on its own device with random parameters, and
    `swap(another copy)`, which returns the module to compare (a new one, or the copy changed
    in place). Both get the same random fp32 inputs of shape (2, 5, *feature_shape) (and one
    more argument per shape of `more_inputs`), the RNG replayed for each (dropout draws the same
    mask), autocast off, no grad. `module` and the RNG are left as they were.
    """
    tensors = list(module.parameters()) + list(module.buffers())
    if any(t.is_meta for t in tensors):
        return "parameters on the meta device: cannot probe"
    device = tensors[0].device if tensors else torch.device("cpu")
    restore = _rng_replay(device)
    gen = torch.Generator().manual_seed(0)
    try:
        ref = copy.deepcopy(module).float()
        with torch.no_grad():
            for t in ref.parameters():  # random, so that a forward ignoring a weight or a bias shows
                scale = t.shape[-1] ** -0.5 if t.dim() > 1 else 0.5
                t.copy_(torch.randn(t.shape, generator=gen) * scale)
        cand = swap(copy.deepcopy(ref))
    except Exception as e:  # noqa: BLE001 -- anything that stops the probe means "not shown equal"
        return f"probe: could not copy or build ({type(e).__name__}: {e})"
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            for args in _probe_inputs((feature_shape, *more_inputs), gen):
                args = [a.to(device) for a in args]
                try:
                    restore()
                    want = ref(*args)
                except Exception as e:  # noqa: BLE001
                    return _probe_raised(ref, args[0], e)
                restore()
                got = cand(*args)
                if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor) or \
                        want.shape != got.shape or want.dtype != got.dtype:
                    return "probe: output is not one tensor of the original's shape and dtype"
                err = (got - want).abs().max().item()
                tol = rtol * max(want.abs().max().item(), 1e-3)
                if not err <= tol:  # NaN fails
                    return f"probe: forward differs from the base operation (max |diff| {err:.1e} > {tol:.1e})"
    except Exception as e:  # noqa: BLE001
        return f"probe: the replacement raised {type(e).__name__}: {e}"
    finally:
        restore()
    return None


def _probe_raised(ref, x, e):
    """The reason for a probe whose original raised on a (..., features) input: channels-first, or unknown."""
    if x.dim() == 3:
        try:  # does it normalise dim 1 of an NCHW tensor instead (timm's LayerNorm2d: permutes)?
            y = ref(x[:, :3].permute(0, 2, 1).unsqueeze(-1).expand(-1, -1, -1, 4).contiguous())
            if y.shape[1] == x.shape[-1]:
                return "channels-first (NCHW) norm, permutes around the op: not replaced"
        except Exception:  # noqa: BLE001
            pass
    return f"probe: the original raised {type(e).__name__} on a (..., {x.shape[-1]}) input"


def _swap_norm(child, backend, out_dtype):
    """The ampkernels norm for `child` (sharing its parameters), or the reason to leave it: the
    first candidate builder the probe proves equal."""
    reasons = []
    for build in _norm_builders(child):
        reason = _hooked(child) or probe(child, lambda m: build(m, backend, None), tuple(child.normalized_shape)
                                         if hasattr(child, "normalized_shape") else tuple(child.weight.shape))
        by_construction = type(child).forward in (torch.nn.LayerNorm.forward, torch.nn.RMSNorm.forward)  # torch's
        if not reason or (by_construction and reason.startswith("parameters on the meta device")):
            return build(child, backend, out_dtype)
        if not reason.startswith("probe: forward differs"):
            return reason  # hooks, meta parameters, a forward that raised: the same for every candidate
        reasons.append(reason)
    if len(reasons) > 1:
        return "; ".join(f"as {n}: {r}" for n, r in zip(("RMSNorm", "RMSNorm * (1 + weight)"), reasons))
    return reasons[0]


# Hugging Face MLP classes: (class name, projection attribute, activation attribute)
_HF_MLPS = (
    ("BertIntermediate", "dense", "intermediate_act_fn"),
    ("RobertaIntermediate", "dense", "intermediate_act_fn"),
    ("BertPredictionHeadTransform", "dense", "transform_act_fn"),
    ("GPT2MLP", "c_fc", "act"),
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


# Hugging Face MLPs with no gate whose forward applies the activation straight to one projection:
# class name -> (projection attribute, activation attribute). Fused only after the probe shows
# the whole MLP computes the same (what follows the activation, dropout or not, stays as it is).
_HF_PLAIN_MLPS = {
    "T5DenseActDense": ("wi", "act"), "MT5DenseActDense": ("wi", "act"), "LongT5DenseActDense": ("wi", "act"),
    "UMT5DenseActDense": ("wi", "act"),
    "GPTNeoXMLP": ("dense_h_to_4h", "act"), "FalconMLP": ("dense_h_to_4h", "act"), "BloomMLP": ("dense_h_to_4h",
                                                                                                 "gelu_impl"),
    "PhiMLP": ("fc1", "activation_fn"), "CodeGenMLP": ("fc_in", "act"), "GPTJMLP": ("fc_in", "act"),
    "GPTNeoMLP": ("c_fc", "act"),
}


# Other Hugging Face MLPs, by structure: modules whose children are these and nothing else (an
# MLP, called on one tensor, which the probe can run whole; not a layer that also holds attention),
# the projection a plain nn.Linear and the activation one activation_name knows -- ViTMLP /
# SiglipMLP-style fc1 -> activation_fn -> fc2, ViTIntermediate-style dense -> intermediate_act_fn,
# Starcoder2MLP / GPTBigCodeMLP-style c_fc -> act -> c_proj. Fused only when the probe shows the
# module's output unchanged.
_HF_MLP_STRUCTURES = (("fc1", "activation_fn", {"fc1", "activation_fn", "fc2", "dropout"}),
                      ("dense", "intermediate_act_fn", {"dense", "intermediate_act_fn", "dropout"}),
                      ("c_fc", "act", {"c_fc", "act", "c_proj", "dropout"}))


def _hf_plain_mlp(m):
    """(projection attribute, activation attribute) if `m` is one of _HF_PLAIN_MLPS or has the
    structure of _HF_MLP_STRUCTURES (not yet fused), else None."""
    if not type(m).__module__.startswith("transformers."):
        return None
    name = type(m).__name__
    if name in _HF_PLAIN_MLPS:
        return _HF_PLAIN_MLPS[name]
    if any(name == known for known, _, _ in _HF_MLPS):
        return None  # fused by name, before this
    for proj, act, children in _HF_MLP_STRUCTURES:
        if set(m._modules) <= children and type(m._modules.get(proj)) is torch.nn.Linear and \
                activation_name(m._modules.get(act)) is not None:
            return proj, act
    return None


def _projection_input_features(proj):
    return proj.in_features if isinstance(proj, torch.nn.Linear) else proj.weight.shape[0]  # Conv1D: (in, out)


def _fuse_hf_plain_mlp(mlp, proj_name, act_name, backend):
    """Fuse the projection + activation of a Hugging Face MLP in place (returns the new projection)
    or return the reason not to (a str). nn.Linear subclasses (FalconLinear) and Conv1D are
    taken when the probe shows the MLP's output unchanged."""
    proj, act = getattr(mlp, proj_name), getattr(mlp, act_name)
    activation = activation_name(act)
    if activation is None:
        return f"activation {act_name} is {_qualified_name(type(act))}: no fused equivalent"
    is_conv1d = type(proj).__name__ == "Conv1D" and type(proj).__module__.startswith("transformers.")
    if not (isinstance(proj, torch.nn.Linear) or is_conv1d):
        return f"{proj_name} is {_qualified_name(type(proj))}: no fused op for it"
    if not (isinstance(proj.weight, torch.Tensor) and proj.weight.is_floating_point()):
        return f"{proj_name}'s weight is not a floating-point tensor (quantized?): no fused op for it"
    reason = _hooked(proj, act)
    if reason:
        return reason

    def fused(m):
        p = getattr(m, proj_name)
        return Conv1DAct(p, activation, backend) if is_conv1d else _new_linear(p, activation, backend)

    def swap(m):
        setattr(m, proj_name, fused(m))
        setattr(m, act_name, torch.nn.Identity())
        return m
    reason = probe(mlp, swap, (_projection_input_features(proj),))
    if reason:
        return reason
    swap(mlp)
    return getattr(mlp, proj_name)


def _sequential_left_alone(seq):
    """(child name, reason) for Linear -> Dropout -> known activation in an nn.Sequential: the dropout
    sits between the matmul and the activation, where no fused op has room for it."""
    names = list(seq._modules)
    out = []
    for a, b, c in zip(names, names[1:], names[2:]):
        lin, drop, act = seq._modules[a], seq._modules[b], seq._modules[c]
        if type(lin) is torch.nn.Linear and isinstance(drop, torch.nn.Dropout) and activation_name(act):
            out.append((a, f"Dropout(p={drop.p}) between {a} and the activation {c}: not fused"))
    return out


def _timm_mlp_kind(m):
    """"mlp" for timm's Mlp and its subclasses (whose forward the probe checks), "gated" for GluMlp / SwiGLU."""
    for t in type(m).__mro__:  # by name, so that timm stays optional
        if t.__module__.startswith("timm.") and t.__name__ in ("Mlp", "GluMlp", "SwiGLU"):
            return "mlp" if t.__name__ == "Mlp" else "gated"
    return None


def _fuse_timm_mlp(mlp, backend):
    """Fuse timm Mlp's fc1 + act in place (returns the new fc1) or return the reason not to (a str).

    Mlp.forward is fc1 -> act -> drop1 -> norm -> fc2 -> drop2: the activation applies straight
    to fc1's output, so drop1 and norm (whatever they are) stay where they are, after it.
    """
    fc1, act = mlp.fc1, mlp.act
    if type(fc1) is not torch.nn.Linear:
        return f"fc1 is {type(fc1).__name__} (use_conv=True or custom): no fused op for it"
    activation = activation_name(act)
    if activation is None:
        return f"activation {_qualified_name(type(act))}: no fused equivalent"
    reason = _hooked(fc1, act)
    if reason:
        return reason

    def swap(m):
        m.fc1, m.act = _new_linear(m.fc1, activation, backend), torch.nn.Identity()
        return m
    reason = probe(mlp, swap, (fc1.in_features,))
    if reason:
        return reason
    mlp.fc1, mlp.act = _new_linear(fc1, activation, backend), torch.nn.Identity()
    return mlp.fc1


def convert(model, *, norms=True, linears=True, backend=None, norm_out_dtype=None, verbose=False):
    """Swap recognised norms and Linear->activation pairs in `model` (in place).

    norms / linears: restrict what is converted. backend: stored on every new module
    (None = "auto"). norm_out_dtype: the new norms' out_dtype (see ampkernels.nn.LayerNorm;
    "autocast" suits transformers whose norm outputs only feed matmuls). Returns
    (model, ConvertReport). A model with nothing recognised is returned unchanged; what was
    recognised but left alone (a probe that failed, a gated MLP, hooks) is in report.skipped
    with the reason.
    """
    if backend is not None:
        from ..backends import requested
        requested(backend)  # validate the name now, not at the first forward
    report = ConvertReport()
    # the report lists modules in model order; the walk below meets a parent's norms before its children
    model_order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    if norms and _norm_builder(model) is not None:
        raise ValueError("convert() swaps submodules; wrap a bare norm in a container or use ampkernels.nn directly")
    if linears:
        _convert_gated_mlps(model, backend, report)
    for path, parent in list(model.named_modules()):
        prefix = f"{path}." if path else ""
        if linears and isinstance(parent, torch.nn.Sequential) and type(parent) is torch.nn.Sequential:
            names = list(parent._modules)
            for a, b in zip(names, names[1:]):
                lin, act = parent._modules[a], parent._modules[b]
                activation = activation_name(act)
                if type(lin) is torch.nn.Linear and activation is not None:
                    reason = _hooked(lin, act)
                    if reason:
                        report.skip(prefix + a, lin, reason)
                        continue
                    new = _new_linear(lin, activation, backend)
                    parent._modules[a], parent._modules[b] = new, torch.nn.Identity()
                    report.add(prefix + a, lin, new)
        mlp = next((m for m in _HF_MLPS if type(parent).__name__ == m[0]), None)
        if linears and mlp and type(parent).__module__.startswith("transformers."):
            proj, act = getattr(parent, mlp[1]), getattr(parent, mlp[2])
            new = _fuse_projection(proj, act, backend)
            reason = new is not None and _hooked(proj, act)
            if reason:
                report.skip(prefix + mlp[1], proj, reason)
            elif new is not None:
                setattr(parent, mlp[1], new)
                setattr(parent, mlp[2], torch.nn.Identity())
                report.add(prefix + mlp[1], proj, new)
        if linears and type(parent) is torch.nn.Sequential:
            for name, reason in _sequential_left_alone(parent):
                report.skip(prefix + name, parent._modules[name], reason)
        plain = _hf_plain_mlp(parent) if linears else None
        if plain:
            old = getattr(parent, plain[0])
            new = _fuse_hf_plain_mlp(parent, *plain, backend)
            if isinstance(new, str):
                report.skip(path, parent, new)
            else:
                report.add(prefix + plain[0], old, new)
        kind = _timm_mlp_kind(parent) if linears else None
        if kind == "mlp":  # gated ones: _convert_gated_mlps
            old = parent.fc1
            new = _fuse_timm_mlp(parent, backend)
            if isinstance(new, str):
                report.skip(path, parent, new)
            else:
                report.add(prefix + "fc1", old, new)
        if norms:
            for name, child in list(parent.named_children()):
                if not _norm_builders(child):
                    continue
                new = _swap_norm(child, backend, norm_out_dtype)
                if isinstance(new, str):
                    report.skip(prefix + name, child, new)
                    continue
                setattr(parent, name, new)
                report.add(prefix + name, child, new)
    if norms:
        _fuse_residuals(model, report)
    report.sort(model_order)
    if verbose:
        print(report)
    return model, report


# ------------------------------------------------------------------ residual adds into the norms

def _is_timm_vit_block(m):
    t = type(m)  # by name, so that timm stays optional; the exact class: a subclass may compute more
    return t.__module__ == "timm.models.vision_transformer" and t.__qualname__ == "Block"


def _fused_blocks(child):
    """FusedResidualBlocks for an exact nn.Sequential of timm Blocks (or the reason to leave it, or
    None when it is not one)."""
    if type(child) is not torch.nn.Sequential or not len(child) or not all(_is_timm_vit_block(b) for b in child):
        return None
    if not all(isinstance(n, (LayerNorm, RMSNorm)) for b in child for n in (b.norm1, b.norm2)):
        return "blocks whose norms were not all replaced: residual adds not fused"
    # hooks on what the fused forward calls as a module (attn, mlp, ...) still run; the
    # blocks' own forward and the norms' (forward_residual) are bypassed
    return _hooked(child, *(m for b in child for m in (b, b.norm1, b.norm2))) or \
        probe(child, lambda m: FusedResidualBlocks(*m), child[0].norm1.normalized_shape) or FusedResidualBlocks(*child)


def _is_hf_post_norm_output(m):
    """BertSelfOutput-shaped: a transformers module of exactly dense (nn.Linear), LayerNorm and
    dropout (nn.Dropout), whose forward the probe then checks against LayerNorm(dropout(dense(h))
    + input_tensor)."""
    return type(m).__module__.startswith("transformers.") and list(m._modules) == ["dense", "LayerNorm", "dropout"] \
        and type(m.dense) is torch.nn.Linear and type(m.dropout) is torch.nn.Dropout


def _fused_post_norm_output(child):
    """FusedPostNormResidual for a BertSelfOutput-shaped module whose LayerNorm was replaced (or
    the reason to leave it, or None when it is not one)."""
    if not _is_hf_post_norm_output(child) or type(child.LayerNorm) is not LayerNorm:
        return None
    return _hooked(child, child.LayerNorm) or probe(
        child, lambda m: FusedPostNormResidual(m.dense, m.LayerNorm, m.dropout), (child.dense.in_features,),
        more_inputs=[(child.dense.out_features,)]) or FusedPostNormResidual(child.dense, child.LayerNorm, child.dropout)


def _fuse_residuals(model, report):
    """The residual adds into the norms (after the norm swap): timm ViT's blocks and Hugging Face's
    post-norm output sublayers, each swap probed."""
    for path, parent in list(model.named_modules()):
        prefix = f"{path}." if path else ""
        for name, child in list(parent.named_children()):
            new = _fused_blocks(child) or _fused_post_norm_output(child)
            if isinstance(new, str):
                report.skip(prefix + name, child, new)
            elif new is not None:
                setattr(parent, name, new)
                report.add(prefix + name, child, new)


# ------------------------------------------------------------------ gated MLPs (SwiGLU / GeGLU)

def _gated_activation(act):
    name = activation_name(act)
    return name if name in GATED_ACTIVATIONS else None


def _is_p0_dropout(m):
    return type(m) is torch.nn.Identity or (type(m) is torch.nn.Dropout and m.p == 0)


def _gated_parts(projections, act, shape_reason=None):
    """(activation, None) for a gated MLP whose projections are all plain nn.Linear and whose act
    has a fused equivalent, else (None, the reason to leave it); shape_reason: a further reason,
    checked after the projections' type."""
    if not all(type(c) is torch.nn.Linear for c in projections):
        return None, "gated MLP whose projections are not nn.Linear"
    if shape_reason:
        return None, shape_reason
    activation = _gated_activation(act)
    if activation is None:
        return None, f"gated MLP with activation {_qualified_name(type(act))}: no fused equivalent"
    return activation, None


def _gated_builder(m):
    """None if `m` is no gated MLP convert knows; else (builder, in_features) or the reason (a str)
    to leave it. builder(module, backend) returns the fused module sharing module's children."""
    if isinstance(m, (FusedGatedMLP, FusedSwiGLU, FusedGluMlp, FusedT5GatedDense, FusedPackedGatedMLP)):
        return None
    # Hugging Face's T5DenseGatedActDense and its copies (mT5, UMT5, ...), by structure
    if set(m._modules) == {"wi_0", "wi_1", "wo", "dropout", "act"} and type(m).__module__.startswith("transformers."):
        activation, reason = _gated_parts((m.wi_0, m.wi_1, m.wo), m.act)
        if reason:
            return reason
        return (lambda old, backend: FusedT5GatedDense(old.wi_0, old.wi_1, old.wo, old.dropout, activation,
                                                       backend=backend), m.wi_0.in_features)
    # a packed gate_up_proj, gate first (HF Phi3MLP, GlmMLP, or anyone's module shaped so), by structure
    if set(m._modules) == {"gate_up_proj", "down_proj", "activation_fn"}:
        odd = getattr(m.gate_up_proj, "out_features", 0) % 2
        activation, reason = _gated_parts((m.gate_up_proj, m.down_proj), m.activation_fn,
                                          "gate_up_proj with an odd number of outputs: no gate and up halves" if odd
                                          else None)
        if reason:
            return reason
        return (lambda old, backend: FusedPackedGatedMLP(old.gate_up_proj, old.down_proj, activation, backend=backend),
                m.gate_up_proj.in_features)
    # by structure (HF LlamaMLP and its copies, or anyone's module shaped so): the probe checks the forward
    if set(m._modules) == {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        activation, reason = _gated_parts((m.gate_proj, m.up_proj, m.down_proj), m.act_fn)
        if reason:
            return reason

        def build(old, backend):
            new = FusedGatedMLP(1, 1, 1, activation, device="meta", backend=backend)
            new.gate_proj, new.up_proj, new.down_proj = old.gate_proj, old.up_proj, old.down_proj
            return new
        return build, m.gate_proj.in_features
    if _timm_mlp_kind(m) != "gated":
        return None
    swiglu = any(t.__name__ == "SwiGLU" for t in type(m).__mro__ if t.__module__.startswith("timm."))
    fcs = (m.fc1_g, m.fc1_x, m.fc2) if swiglu else (m.fc1, m.fc2)
    if not all(type(c) is torch.nn.Linear for c in fcs):
        return "gated MLP whose projections are not nn.Linear (use_conv=True or custom)"
    activation = _gated_activation(m.act)
    if activation is None:
        return f"gated MLP with activation {_qualified_name(type(m.act))}: no fused equivalent"
    if type(m.norm) is not torch.nn.Identity:
        return f"gated MLP with a norm ({type(m.norm).__name__}) before fc2: not fused"
    if not _is_p0_dropout(m.drop1):
        return "gated MLP with dropout before fc2: not fused"
    if swiglu:
        return (lambda old, backend: FusedSwiGLU(old.fc1_g, old.fc1_x, old.fc2, old.drop2, activation, backend=backend),
                m.fc1_g.in_features)
    return (lambda old, backend: FusedGluMlp(old.fc1, old.fc2, old.drop2, activation, old.gate_last, backend=backend),
            m.fc1.in_features)


def _convert_gated_mlps(model, backend, report):
    """Swap every recognised gated MLP under `model` whole (before the per-projection pass, which
    then meets only the fused modules)."""
    if _gated_builder(model) is not None:
        report.skip("", model, "gated MLP at the model's root: convert swaps submodules")
    for path, parent in list(model.named_modules()):
        prefix = f"{path}." if path else ""
        for name, child in list(parent.named_children()):
            found = _gated_builder(child)
            if found is None:
                continue
            reason = found if isinstance(found, str) else None
            if reason is None:
                build, features = found
                # probed through "auto" (fp32 takes the torch path): the probe checks the module's
                # computation, an explicit backend would refuse its fp32 inputs
                reason = _hooked(child, *child.children()) or probe(child, lambda m: build(m, None), (features,))
            if reason:
                report.skip(prefix + name, child, reason)
                continue
            new = build(child, backend)
            setattr(parent, name, new)
            report.add(prefix + name, child, new)


__all__ = ["convert", "ConvertReport", "Replacement", "Skipped", "Conv1DAct", "activation_name", "probe"]
