"""Helpers several ops share: the eager fast path's test, F.linear's autocast dtype rule for the
ops built on GEMMs, and whether a saved tensor may be freed inside its backward."""
import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def eager_call(*tensors):
    """True when the call may skip the custom-op wrapper and run the implementation directly.

    The custom op is what tracing needs (torch.compile, export, fake and other subclass tensors);
    in plain eager mode its Python wrapper costs tens of microseconds per call, as much as a
    small GEMM takes on the GPU. Both routes run the same implementation."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:  # a loop, not all(<generator>): this runs per call, on the host's critical path
        if t is not None and type(t) not in _PLAIN:
            return False
    return True


def autocast_dtypes(op, x, params, names, what="x, weight and bias"):
    """F.linear's dtype rule, for the ops built on GEMMs: under autocast x is cast to the autocast
    dtype, and cast_to is that dtype when a parameter differs from it (fp32 master weights, cast
    inside the op's Function); without autocast x and the parameters must share a dtype
    (TypeError naming each). Returns (x, cast_to)."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        dtype = torch.get_autocast_dtype(device)
        if x.dtype != dtype:
            x = x.to(dtype)
        for t in params:
            if t is not None and t.dtype != x.dtype:
                return x, x.dtype
        return x, None
    if any(t is not None and t.dtype != x.dtype for t in params):
        got = ", ".join(f"{n} {None if t is None else t.dtype}" for n, t in zip(("x", *names), (x, *params)))
        raise TypeError(f"{op}: {what} must share a dtype (as for F.linear), got {got}")
    return x, None


def dies_with_this_backward(saved):
    """True when a saved tensor may be freed inside backward, as soon as it is used.

    Autograd frees a node's saved tensors after its backward unless the graph is kept
    (retain_graph / create_graph): then a later backward reads them again, and they stay. The
    tensor must own its whole storage (forward made it; a saved-tensor hook may hand back
    something else). Freeing pre (and our cast of w2) before layer 1's gradients are formed
    lowers the step's peak where weight gradients are large against activations (T=8192,
    H=4096: pre is 256 MiB, w2's cast 128 MiB)."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return (keep_graph is not None and not keep_graph() and saved._base is None
            and saved.untyped_storage().nbytes() == saved.numel() * saved.element_size())
