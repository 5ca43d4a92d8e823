"""Hugging Face transformers: `apply(model)` converts a model in place, fuses its rotary
embedding (ampkernels.integrations.rotary) and, for a causal LM or a BERT-style masked LM, its LM
head and loss (ampkernels.integrations.loss);
`ConvertCallback` does it from inside a Trainer when training begins.

convert() shares the Parameter objects, so apply() may run before or after an optimizer,
Trainer, accelerate.prepare or DDP is set up: what they hold keeps pointing at the same tensors,
and state_dict / save_pretrained keys are unchanged (a converted model's checkpoint loads into
an unconverted one).
"""
from transformers import TrainerCallback

from . import convert_wrapped, unwrap
from .loss import check_lm_fusable, fuse_lm_loss
from .rotary import fuse_rotary as _fuse_rotary


def apply(model, *, fuse_loss=True, fuse_rotary=True, **convert_kwargs):
    """Convert `model` (a transformers model, or any nn.Module; DDP and torch.compile wrappers
    are looked through) in place; returns the ConvertReport. convert_kwargs: those of
    ampkernels.nn.convert (norms, linears, backend, norm_out_dtype, verbose).

    fuse_loss: also fuse a causal or masked LM's head and loss (fuse_lm_loss: training with
    labels never builds the logits); a model it cannot take is listed in report.skipped with
    the reason and keeps its own loss.
    fuse_rotary: run the attention modules' apply_rotary_pos_emb as ampkernels.rotary_embedding
    (report.fused_rotary counts them)."""
    report = convert_wrapped(model, convert_kwargs)
    inner = unwrap(model)
    if fuse_rotary:
        report.fused_rotary = _fuse_rotary(inner, report, convert_kwargs.get("backend"))
    if fuse_loss and callable(getattr(inner, "get_output_embeddings", None)) and \
            inner.get_output_embeddings() is not None:
        try:
            check_lm_fusable(inner)
        except ValueError as e:
            report.skip("", inner, f"LM head + loss not fused: {e}")
        else:
            fuse_lm_loss(inner, backend=convert_kwargs.get("backend"))
            report.fused_loss = True
    return report


class ConvertCallback(TrainerCallback):
    """Converts the Trainer's model at on_train_begin (after Trainer and accelerate have set it
    up: the optimizer's parameters are the model's, unchanged). The report is `.report`."""

    def __init__(self, **convert_kwargs):
        self.convert_kwargs, self.report = convert_kwargs, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("ConvertCallback: the Trainer passed no model to on_train_begin")
        self.report = apply(model, **self.convert_kwargs)
        return control


__all__ = ["apply", "ConvertCallback"]
