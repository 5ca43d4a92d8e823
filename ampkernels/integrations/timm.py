"""timm: `apply(model)` converts a timm model in place (norms, RmsNorm, Mlp's fc1 + activation).

The same Parameter objects stay in the model, so optimizers, EMA copies and checkpoints (timm's
state_dict keys) are unaffected."""
from . import convert_wrapped


def apply(model, **convert_kwargs):
    """Convert `model` in place (DDP and torch.compile wrappers are looked through); returns the
    ConvertReport. convert_kwargs: those of ampkernels.nn.convert."""
    return convert_wrapped(model, convert_kwargs)


__all__ = ["apply"]
