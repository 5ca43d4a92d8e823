"""One-line integrations: convert a Hugging Face or timm model where it is built.

    from ampkernels.integrations import transformers as ak_hf
    report = ak_hf.apply(model)            # before Trainer / accelerate.prepare, or
    Trainer(..., callbacks=[ak_hf.ConvertCallback()])

    from ampkernels.integrations import timm as ak_timm
    report = ak_timm.apply(model)

    from ampkernels.integrations.loss import fuse_lm_loss
    fuse_lm_loss(model)                    # a causal or masked LM's head + loss without the logits

apply() is ampkernels.nn.convert (same keyword arguments, same report). Importing
ampkernels.integrations.transformers imports transformers (for TrainerCallback); the timm one
needs nothing of timm.
"""
import torch

from ..nn.convert import convert


def unwrap(model):
    """The module a wrapper runs: DistributedDataParallel / DataParallel (.module) and torch.compile's
    OptimizedModule (._orig_mod), looked through at any depth."""
    while True:
        for attr in ("module", "_orig_mod"):
            inner = getattr(model, attr, None)
            if isinstance(inner, torch.nn.Module) and type(model).__name__ in _WRAPPERS:
                model = inner
                break
        else:
            return model


_WRAPPERS = ("DistributedDataParallel", "DataParallel", "OptimizedModule")


def convert_wrapped(model, convert_kwargs):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"apply: model must be a torch.nn.Module, got {type(model).__name__}")
    _, report = convert(unwrap(model), **convert_kwargs)
    return report
