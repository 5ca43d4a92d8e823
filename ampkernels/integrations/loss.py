"""fuse_causal_lm_loss(model): a Hugging Face causal LM whose training loss never builds the logits.

    model = AutoModelForCausalLM.from_pretrained(...)
    ampkernels.integrations.loss.fuse_causal_lm_loss(model)
    loss = model(input_ids, labels=labels).loss        # in model.train(): no (tokens, vocab) logits

No per-model copy of a forward: the model's own forward is wrapped (an instance attribute; the
class, the parameters, state_dict and save_pretrained are untouched). When the model is
training and labels are given, the wrapper runs the model's base model (`model.base_model`) with
the same arguments the model's forward would pass it, takes `last_hidden_state`, and computes
ampkernels.linear_cross_entropy with the output embeddings' weight (and bias) under Hugging
Face's causal-LM convention (ForCausalLMLoss): position t predicts labels[t + 1] (or the given
`shift_labels`), ignore_index -100, mean over the counted tokens, or the sum divided by
`num_items_in_batch` when the Trainer passes it. It returns the model's own output class with
`loss` set and `logits=None`. Otherwise (eval, generation, no labels) the original forward runs.

The wrapper is only correct for a forward of the form base model -> lm_head -> loss_function;
fuse_causal_lm_loss checks that from the forward's source and the config and refuses
(ValueError, naming the reason) models that change the hidden states or the logits in between
(final logit softcapping, logit scales), a head that is not a plain nn.Linear (a LoRA/quantized
head), a custom loss_function, or a forward already wrapped by someone else.
"""
import dataclasses
import functools
import inspect
import re
import sys
import types

import torch
import torch.nn.functional as F

from ..ops.linear_cross_entropy import linear_cross_entropy

_ATTR = "_ampkernels_fused_loss"
# config attributes whose models transform the logits after lm_head (Gemma 2/3, Cohere, Granite, ...)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logit_softcapping",
                     "output_multiplier_scale", "lm_head_multiplier")
_LOSS_ONLY_KWARGS = ("shift_labels", "num_items_in_batch", "ignore_index")


def _refuse(model, why):
    raise ValueError(f"fuse_causal_lm_loss: cannot fuse {type(model).__name__}: {why}; the model is left as it was")


def _forward_source(cls):
    fn = inspect.unwrap(cls.forward)
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def _check_forward_source(model, src):
    """The forward must be: outputs = self.<base>(...); hidden = outputs.last_hidden_state (or [0])
    (sliced by logits_to_keep at most); logits = self.lm_head(hidden...); loss = self.loss_function(
    logits, labels, ...): nothing else may touch the hidden states or the logits."""
    prefix = model.base_model_prefix
    code = [ln.split("#")[0].rstrip() for ln in src.splitlines()]
    code = [ln for ln in code if ln.strip()]
    base_at = next((i for i, ln in enumerate(code) if re.search(rf"self\.{re.escape(prefix)}\(", ln)), None)
    head_at = [i for i, ln in enumerate(code) if "self.lm_head(" in ln]
    loss_at = [i for i, ln in enumerate(code) if "self.loss_function(" in ln]
    if base_at is None or len(head_at) != 1 or len(loss_at) != 1 or not base_at < head_at[0] < loss_at[0]:
        _refuse(model, f"its forward is not 'self.{prefix}(...) -> self.lm_head(...) -> self.loss_function(...)'")
    if not re.search(r"logits\s*=\s*self\.lm_head\(", code[head_at[0]]):
        _refuse(model, f"its lm_head line is not 'logits = self.lm_head(...)': {code[head_at[0]].strip()!r}")
    # between the base call and lm_head: only taking the last hidden state and slicing it
    allowed = re.compile(r"(hidden_states\s*=\s*(outputs|transformer_outputs|\w+_outputs)(\.last_hidden_state|\[0\])"
                         r"|hidden_states\s*=\s*slice_logits_to_keep\(|slice_indices\s*=)")
    depth = 0  # inside the base call's parentheses (its keyword arguments) nothing is checked
    for i in range(base_at, head_at[0]):
        ln = code[i]
        if depth == 0 and i > base_at and "hidden_states" in ln and "=" in ln and not allowed.search(ln):
            _refuse(model, f"its forward changes the hidden states before lm_head: {ln.strip()!r}")
        depth += ln.count("(") - ln.count(")")
    for ln in code[head_at[0] + 1:loss_at[0]]:
        if re.search(r"\blogits\b", ln):
            _refuse(model, f"its forward changes the logits before the loss: {ln.strip()!r}")


def _output_class(cls):
    from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput
    ann = inspect.signature(inspect.unwrap(cls.forward)).return_annotation
    if isinstance(ann, str):
        ann = getattr(sys.modules[cls.__module__], ann.split("|")[-1].strip(), None)
    if isinstance(ann, type) and issubclass(ann, ModelOutput):
        return ann
    for arg in getattr(ann, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, ModelOutput):
            return arg
    return CausalLMOutputWithPast


def check_fusable(model):
    """None if fuse_causal_lm_loss can wrap `model`; else raises ValueError naming the reason."""
    try:
        from transformers import PreTrainedModel
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError as e:
        raise ValueError(f"fuse_causal_lm_loss needs transformers: {e}") from None
    if not isinstance(model, PreTrainedModel):
        _refuse(model, "it is not a transformers PreTrainedModel")
    if "forward" in vars(model):
        _refuse(model, "its forward is already wrapped on the instance (accelerate hooks, a patch)")
    base = model.base_model
    if base is model:
        _refuse(model, f"it has no base model (base_model_prefix {model.base_model_prefix!r})")
    head = model.get_output_embeddings()
    if head is None or type(head).forward is not torch.nn.Linear.forward or not isinstance(head, torch.nn.Linear):
        _refuse(model, f"its output embeddings are not a plain nn.Linear ({type(head).__name__})")
    if head._forward_hooks or head._forward_pre_hooks or model._forward_hooks or model._forward_pre_hooks:
        _refuse(model, "it or its lm_head has forward hooks")
    cfg = model.config
    for name in _LOGIT_TRANSFORMS:
        if getattr(cfg, name, None) not in (None, 1, 1.0):
            _refuse(model, f"config.{name} = {getattr(cfg, name)!r} transforms the logits")
    if getattr(model, "_loss_function", ForCausalLMLoss) is not ForCausalLMLoss:
        _refuse(model, "it has a custom loss_function")
    if head.weight.shape[0] != cfg.get_text_config().vocab_size:
        _refuse(model, f"lm_head has {head.weight.shape[0]} rows but the vocab size is "
                       f"{cfg.get_text_config().vocab_size}")
    params = inspect.signature(inspect.unwrap(type(model).forward)).parameters
    if "labels" not in params:
        _refuse(model, "its forward takes no labels")
    src = _forward_source(type(model))
    if src is None:
        _refuse(model, "the source of its forward is unavailable to check")
    _check_forward_source(model, src)


def _forward_info(cls):
    """(signature of cls.forward, its **kwargs parameter's name or None, the output class and its
    field names): read once, when the loss is fused, not on every training step."""
    sig = inspect.signature(inspect.unwrap(cls.forward))
    var_kw = next((n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    out_cls = _output_class(cls)
    return sig, var_kw, out_cls, tuple(f.name for f in dataclasses.fields(out_cls))


def _fused_forward(self, info, *args, **kwargs):
    cls = type(self)
    sig, var_kw, out_cls, fields = info
    try:
        bound = sig.bind(self, *args, **kwargs)
    except TypeError:
        return cls.forward(self, *args, **kwargs)  # let the model's own forward raise
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(sig.parameters)))  # self
    extra = dict(arguments.pop(var_kw, {})) if var_kw else {}
    labels = arguments.get("labels")
    if labels is None or not self.training:
        return cls.forward(self, *args, **kwargs)
    backend = getattr(self, _ATTR)
    arguments.pop("labels")
    arguments.pop("logits_to_keep", None)
    return_dict = extra.pop("return_dict", getattr(self.config, "return_dict", True))
    return_dict = True if return_dict is None else return_dict
    outputs = self.base_model(**arguments, **extra)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    ignore_index = extra.get("ignore_index", -100)
    shift = extra.get("shift_labels")
    if shift is None:
        shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if shift.numel() != hidden.shape[:-1].numel():
        return cls.forward(self, *args, **kwargs)  # labels not aligned with the hidden states: the model knows
    shift = shift.to(hidden.device).reshape(hidden.shape[:-1])
    head = self.get_output_embeddings()
    n_items = extra.get("num_items_in_batch")
    loss = linear_cross_entropy(hidden, head.weight, shift, head.bias, ignore_index=ignore_index,
                                reduction="mean" if n_items is None else "sum", backend=backend)
    if n_items is not None:
        loss = loss / (n_items.to(loss.device) if torch.is_tensor(n_items) else n_items)
    values = {name: getattr(outputs, name, None) for name in fields}
    values.update(loss=loss, logits=None)
    out = out_cls(**values)
    return out if return_dict else out.to_tuple()


def fuse_causal_lm_loss(model, *, backend=None):
    """Wraps `model.forward` so that training with labels computes the loss with
    ampkernels.linear_cross_entropy (no logits; `outputs.logits` is None then). Returns the
    model. Raises ValueError (the model unchanged) when the model's forward is not the standard
    base -> lm_head -> loss shape (see the module docstring). backend: as for the op."""
    if getattr(model, _ATTR, False) is not False:
        setattr(model, _ATTR, backend)  # already fused: only the backend changes
        return model
    check_fusable(model)
    object.__setattr__(model, _ATTR, backend)
    # the class forward's signature and name on the wrapper: Trainer keeps the dataset columns
    # that forward's signature names (a bare *args/**kwargs wrapper made it drop input_ids)
    info = _forward_info(type(model))

    @functools.wraps(type(model).forward)
    def forward(self, *args, **kwargs):
        return _fused_forward(self, info, *args, **kwargs)

    model.forward = types.MethodType(forward, model)
    return model


def unfuse_causal_lm_loss(model):
    """Undoes fuse_causal_lm_loss (the class's forward runs again)."""
    if getattr(model, _ATTR, False) is not False:
        del model.forward
        object.__delattr__(model, _ATTR)
    return model


def is_fused(model):
    return getattr(model, _ATTR, False) is not False
