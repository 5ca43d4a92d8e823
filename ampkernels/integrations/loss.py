"""fuse_causal_lm_loss(model) / fuse_masked_lm_loss(model): a Hugging Face causal LM or BERT-style
masked LM whose training loss never builds the logits.

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

fuse_masked_lm_loss does the same for a masked LM whose head is BERT's (BertForMaskedLM and the
models built like it: base model -> head.transform -> head.decoder -> CrossEntropyLoss() over
the flattened logits and labels, ignore_index -100). Only the labelled tokens need the head: in
the wrapper keeps those rows and runs the transform and the fused loss on them alone (15% of the
tokens in BERT's recipe). Finding them is one host sync (`nonzero`), made before the base model
runs so that it waits for no work of the step; under torch.compile it is an op whose length is
known at run time, so the graph neither breaks nor recompiles when the count changes.
"""
import ast
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
import types

import torch
import torch.nn.functional as F

from ..ops.linear_cross_entropy import linear_cross_entropy

_ATTR = "_ampkernels_fused_loss"
# config attributes whose models transform the logits after lm_head (Gemma 2/3, Cohere, Granite, ...)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logit_softcapping",
                     "output_multiplier_scale", "lm_head_multiplier")
_LOSS_ONLY_KWARGS = ("shift_labels", "num_items_in_batch", "ignore_index")


def _refuse(model, why, op="fuse_causal_lm_loss"):
    raise ValueError(f"{op}: cannot fuse {type(model).__name__}: {why}; the model is left as it was")


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


def _output_class(cls, default=None):
    from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput
    ann = inspect.signature(inspect.unwrap(cls.forward)).return_annotation
    if isinstance(ann, str):
        ann = getattr(sys.modules[cls.__module__], ann.split("|")[-1].strip(), None)
    if isinstance(ann, type) and issubclass(ann, ModelOutput):
        return ann
    for arg in getattr(ann, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, ModelOutput):
            return arg
    return default or CausalLMOutputWithPast


def _check_common(model, refuse):
    """The checks both fusions make: a transformers model with a base model and a plain
    nn.Linear output embedding as wide as the vocabulary, no hooks, forward not wrapped, taking
    labels. Returns the output embedding."""
    try:
        from transformers import PreTrainedModel
    except ImportError as e:
        refuse(model, f"it needs transformers: {e}")
    if not isinstance(model, PreTrainedModel):
        refuse(model, "it is not a transformers PreTrainedModel")
    if "forward" in vars(model):
        refuse(model, "its forward is already wrapped on the instance (accelerate hooks, a patch)")
    if model.base_model is model:
        refuse(model, f"it has no base model (base_model_prefix {model.base_model_prefix!r})")
    head = model.get_output_embeddings()
    if head is None or type(head).forward is not torch.nn.Linear.forward or not isinstance(head, torch.nn.Linear):
        refuse(model, f"its output embeddings are not a plain nn.Linear ({type(head).__name__})")
    if head._forward_hooks or head._forward_pre_hooks or model._forward_hooks or model._forward_pre_hooks:
        refuse(model, "it or its output embeddings have forward hooks")
    if head.weight.shape[0] != model.config.get_text_config().vocab_size:
        refuse(model, f"its output embeddings have {head.weight.shape[0]} rows but the vocab size is "
                      f"{model.config.get_text_config().vocab_size}")
    if "labels" not in inspect.signature(inspect.unwrap(type(model).forward)).parameters:
        refuse(model, "its forward takes no labels")
    return head


def check_fusable(model):
    """None if fuse_causal_lm_loss can wrap `model`; else raises ValueError naming the reason."""
    _check_common(model, _refuse)
    from transformers.loss.loss_utils import ForCausalLMLoss
    cfg = model.config
    for name in _LOGIT_TRANSFORMS:
        if getattr(cfg, name, None) not in (None, 1, 1.0):
            _refuse(model, f"config.{name} = {getattr(cfg, name)!r} transforms the logits")
    if getattr(model, "_loss_function", ForCausalLMLoss) is not ForCausalLMLoss:
        _refuse(model, "it has a custom loss_function")
    src = _forward_source(type(model))
    if src is None:
        _refuse(model, "the source of its forward is unavailable to check")
    _check_forward_source(model, src)


def _forward_info(cls, default_output=None):
    """(signature of cls.forward, its **kwargs parameter's name or None, the output class and its
    field names): read once, when the loss is fused, not on every training step."""
    sig = inspect.signature(inspect.unwrap(cls.forward))
    var_kw = next((n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    out_cls = _output_class(cls, default_output)
    return sig, var_kw, out_cls, tuple(f.name for f in dataclasses.fields(out_cls))


def _causal_loss(self, labels, extra, backend):
    ignore_index = extra.get("ignore_index", -100)
    shift = extra.get("shift_labels")
    if shift is None:
        shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = self.get_output_embeddings()
    n_items = extra.get("num_items_in_batch")

    def loss(hidden):
        if shift.numel() != hidden.shape[:-1].numel():
            return None  # labels not aligned with the hidden states: the model knows
        out = linear_cross_entropy(hidden, head.weight, shift.to(hidden.device).reshape(hidden.shape[:-1]), head.bias,
                                   ignore_index=ignore_index, reduction="mean" if n_items is None else "sum",
                                   backend=backend)
        if n_items is not None:
            out = out / (n_items.to(out.device) if torch.is_tensor(n_items) else n_items)
        return out
    return loss


# it syncs with the GPU, so no CUDA graph may hold it (inductor also leaves graphs with its
# run-time length out of CUDA graphs); torch without the tag takes no tags here
_SYNCS = {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") else {}


@torch.library.custom_op("ampkernels::labelled_rows", mutates_args=(), **_SYNCS)
def labelled_rows(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The indices of target's entries that are not ignore_index. An op, so that torch.compile
    traces it with a data-dependent length (fullgraph too) instead of breaking the graph."""
    return (target != ignore_index).nonzero().squeeze(1)


@labelled_rows.register_fake
def _(target, ignore_index):
    n, ctx = target.numel(), torch.library.get_ctx()
    # the bound only where it is a number: with dynamic shapes numel is symbolic, which torch refuses there
    size = ctx.new_dynamic_size(max=n) if isinstance(n, int) else ctx.new_dynamic_size()
    return target.new_empty((size,), dtype=torch.long)


def _capturing(t):
    """Whether a CUDA graph is being captured on t's device (in eager mode: under torch.compile
    inductor keeps labelled_rows out of its CUDA graphs)."""
    return not torch.compiler.is_compiling() and t.is_cuda and torch.cuda.is_current_stream_capturing()


def _masked_loss(self, labels, extra, backend):
    pred = self.get_submodule(getattr(self, _HEAD_ATTR))
    t = labels.to(pred.decoder.weight.device).reshape(-1)
    # only the labelled rows need the head. Finding them syncs with the GPU, so it happens here,
    # before the base model's work is queued: the host waits for what earlier steps queued, not
    # for this step's encoder. A CUDA graph being captured cannot sync: there every row runs and
    # the loss ignores the unlabelled ones.
    keep = None if _capturing(t) else labelled_rows(t, -100)

    def loss(hidden):
        if t.numel() != hidden.shape[:-1].numel():
            return None
        h, target = hidden.reshape(-1, hidden.shape[-1]), t
        if keep is not None:
            h, target = h.index_select(0, keep), t.index_select(0, keep)
        return linear_cross_entropy(pred.transform(h), pred.decoder.weight, target, pred.decoder.bias,
                                    ignore_index=-100, backend=backend)
    return loss


def _fused_forward(self, info, loss_fn, *args, **kwargs):
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
    loss_of = loss_fn(self, labels, extra, backend)  # before the base model: see _masked_loss
    outputs = self.base_model(**arguments, **extra)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    loss = loss_of(hidden)
    if loss is None:
        return cls.forward(self, *args, **kwargs)
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
    _wrap(model, _forward_info(type(model)), _causal_loss)
    return model


def _wrap(model, info, loss_fn):
    @functools.wraps(type(model).forward)
    def forward(self, *args, **kwargs):
        return _fused_forward(self, info, loss_fn, *args, **kwargs)

    model.forward = types.MethodType(forward, model)


# ---------------------------------------------------------------- masked LMs (BERT's head)

_HEAD_ATTR = "_ampkernels_mlm_head"


_refuse_masked = functools.partial(_refuse, op="fuse_masked_lm_loss")


def _statements(fn):
    """The statements of fn's body as source (ast.unparse: one spelling whatever the layout),
    docstring left out; None when the source is unavailable."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError):
        return None
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return [ast.unparse(stmt) for stmt in body]


def _masked_head(model, decoder):
    """(path, head) of the module holding `transform` and `decoder` (BertLMPredictionHead), the
    modules between the model and it passing their input straight on; raises ValueError else."""
    path = next((name for name, m in model.named_modules() if getattr(m, "decoder", None) is decoder), None)
    if path is None or not isinstance(getattr(model.get_submodule(path), "transform", None), torch.nn.Module):
        _refuse_masked(model, "its output embeddings are not the decoder of a head with a transform (BERT's)")
    head = model.get_submodule(path)
    code = _statements(type(head).forward)
    if code is None or len(code) != 3 or not re.fullmatch(r"(\w+) = self\.transform\(\w+\)", code[0]) or \
            not re.fullmatch(r"(\w+) = self\.decoder\(\1\)", code[1]) or code[2] != f"return {code[1].split()[0]}":
        _refuse_masked(model, f"{type(head).__name__}.forward is not 'transform, then decoder'")
    parts = path.split(".")
    for i in range(1, len(parts)):  # BertOnlyMLMHead: return self.predictions(sequence_output)
        outer = model.get_submodule(".".join(parts[:i]))
        code = _statements(type(outer).forward)
        call = rf"self\.{re.escape(parts[i])}\(\w+\)"
        if code is None or not (len(code) == 1 and re.fullmatch(rf"return {call}", code[0]) or len(code) == 2 and
                                re.fullmatch(rf"(\w+) = {call}", code[0]) and code[1] == f"return {code[0].split()[0]}"):
            _refuse_masked(model, f"{type(outer).__name__}.forward does more than call its {parts[i]}")
    for m in (model.get_submodule(".".join(parts[:i])) for i in range(1, len(parts) + 1)):
        if m._forward_hooks or m._forward_pre_hooks:
            _refuse_masked(model, f"{type(m).__name__} has forward hooks")
    return path, head


def check_masked_fusable(model):
    """(path of the head) if fuse_masked_lm_loss can wrap `model`; else raises ValueError naming
    the reason."""
    decoder = _check_common(model, _refuse_masked)
    if not _is_masked_lm(type(model)):
        _refuse_masked(model, "its forward does not return a MaskedLMOutput")
    path, _ = _masked_head(model, decoder)
    code = _statements(type(model).forward)
    if code is None:
        _refuse_masked(model, "the source of its forward is unavailable to check")
    prefix, top = re.escape(model.base_model_prefix), re.escape(path.split(".")[0])
    # outputs = self.bert(...); sequence_output = outputs[0]; scores = self.cls(sequence_output);
    # ... CrossEntropyLoss() over scores.view(-1, vocab) and labels.view(-1) ...; return
    pattern = (rf"(\w+) = self\.{prefix}\(.*?\)\n(\w+) = \1\[0\]\n(\w+) = self\.{top}\(\2\)\n.*?"
               rf"\b(\w+) = CrossEntropyLoss\(\)\n\s*\w+ = \4\(\3\.view\(-1, self\.config\.vocab_size\), "
               rf"labels\.view\(-1\)\)\n")
    if not re.search(pattern, "\n".join(code), re.DOTALL):
        _refuse_masked(model, f"its forward is not 'self.{model.base_model_prefix}(...) -> self.{path.split('.')[0]}"
                              "(...) -> CrossEntropyLoss()(scores.view(-1, vocab), labels.view(-1))'")
    return path


def fuse_masked_lm_loss(model, *, backend=None):
    """Wraps `model.forward` (a BERT-style masked LM) so that training with labels computes the
    loss with the head's transform and ampkernels.linear_cross_entropy on the labelled tokens
    only (no logits; `outputs.logits` is None then). Returns the model; raises ValueError (the
    model unchanged) for another structure (see the module docstring)."""
    if getattr(model, _ATTR, False) is not False:
        setattr(model, _ATTR, backend)
        return model
    path = check_masked_fusable(model)
    from transformers.modeling_outputs import MaskedLMOutput
    object.__setattr__(model, _ATTR, backend)
    object.__setattr__(model, _HEAD_ATTR, path)
    _wrap(model, _forward_info(type(model), MaskedLMOutput), _masked_loss)
    return model


def _is_masked_lm(cls):
    from transformers.modeling_outputs import MaskedLMOutput
    return issubclass(_output_class(cls), MaskedLMOutput)


def fuse_lm_loss(model, *, backend=None):
    """fuse_masked_lm_loss for a model whose forward returns a MaskedLMOutput, else
    fuse_causal_lm_loss."""
    fuse = fuse_masked_lm_loss if _is_masked_lm(type(model)) else fuse_causal_lm_loss
    return fuse(model, backend=backend)


def check_lm_fusable(model):
    """check_fusable or check_masked_fusable, as fuse_lm_loss would choose."""
    (check_masked_fusable if _is_masked_lm(type(model)) else check_fusable)(model)


def unfuse_causal_lm_loss(model):
    """Undoes fuse_causal_lm_loss or fuse_masked_lm_loss (the class's forward runs again)."""
    if getattr(model, _ATTR, False) is not False:
        del model.forward
        object.__delattr__(model, _ATTR)
        if _HEAD_ATTR in vars(model):
            object.__delattr__(model, _HEAD_ATTR)
    return model


def is_fused(model):
    return getattr(model, _ATTR, False) is not False
