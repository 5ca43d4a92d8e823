"""Plain-PyTorch references of every ampkernels op, with the exact dtype contract.

They are the test oracle, the CPU path and the fallback for inputs a kernel does not
take. All math is fp32 (or float64 when the input is float64, for tests); nothing here
depends on autocast being on or off.

Contract (docs/design.md, "Op semantics"):
- layer_norm / rms_norm: statistics and normalisation in fp32; output in x.dtype unless
  out_dtype says otherwise; mean/rstd in fp32. With a residual: s = x + residual (in fp32),
  out = norm(s) of that fp32 sum, and s is returned in fp32 when residual_in_fp32 else in
  x.dtype.
- linear_act: y = act(x @ weight.T + bias) accumulated in fp32, returned in x.dtype; the
  pre-activation (what backward needs) is x @ weight.T + bias rounded to x.dtype.
- gated_linear_act: h = act(g) * u with g = x @ gate_weight.T + gate_bias and
  u = x @ up_weight.T + up_bias accumulated in fp32, each rounded to x.dtype (what backward
  reads), act(g) * u in fp32, returned in x.dtype.
- rotary_embedding: x * cos + rotate_half(x) * sin in torch's promoted dtype (the kernels: fp32
  math, one rounding, any out_dtype).
"""
import math

import torch
import torch.nn.functional as F

# Order matches csrc/ampkernels.h `Activation`.
ACTIVATIONS = ("identity", "relu", "gelu", "gelu_tanh", "silu", "squared_relu")


def activation_id(name):
    """Index of an activation name, or a ValueError that lists the choices."""
    try:
        return ACTIVATIONS.index(name)
    except ValueError:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}") from None


def act_fwd(z, name):
    """act(z), as torch defines it, in z's dtype."""
    activation_id(name)
    if name == "identity":
        return z
    if name == "relu":
        return F.relu(z)
    if name == "gelu":
        return F.gelu(z)
    if name == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if name == "silu":
        return F.silu(z)
    r = F.relu(z)  # squared_relu: r * r, not square(), which CUDA autocast runs (as pow) in fp32
    return r * r


def act_grad(z, name):
    """d act / dz at z, in z's dtype (the derivative torch's autograd uses)."""
    activation_id(name)
    if name == "identity":
        return torch.ones_like(z)
    if name == "relu":
        return (z > 0).to(z.dtype)
    if name == "gelu":
        cdf = 0.5 * (1 + torch.erf(z * math.sqrt(0.5)))
        return cdf + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    if name == "gelu_tanh":
        k = math.sqrt(2 / math.pi)
        t = torch.tanh(k * (z + 0.044715 * z**3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * k * (1 + 3 * 0.044715 * z * z)
    if name == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    return 2 * F.relu(z)  # squared_relu


def _compute_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def bias_act(z, bias, activation):
    """(y, pre): pre = z + bias rounded to z.dtype, y = act(pre) in z.dtype (the unfused path)."""
    ct = _compute_dtype(z)
    pre = z.to(ct, copy=True) if bias is None else z.to(ct) + bias.to(ct)
    pre = pre.to(z.dtype)
    return act_fwd(pre.to(ct), activation).to(z.dtype, copy=True), pre  # never aliases an input


def bias_act_backward(dy, pre, activation, dbias_dtype=None):
    """(dz, dbias): dz = dy * act'(pre) in dy.dtype; dbias = column sums of dz, accumulated in fp32."""
    ct = _compute_dtype(dy)
    dz = (dy.to(ct) * act_grad(pre.to(ct), activation)).to(dy.dtype)
    dbias = None if dbias_dtype is None else dz.to(ct).sum(0).to(dbias_dtype)
    return dz, dbias


# Block-wise forms of the two elementwise passes above, for the torch paths of the ops (the
# CPU stand-in for the kernels): same bits, but the fp32 temporaries are one block of rows,
# not a second and third copy of a hidden-sized tensor, so that what a step allocates on CPU
# is what the kernels allocate on the GPU (just the output).

def row_blocks(t):
    """Row ranges of a 2-D tensor for a block-wise elementwise pass: ~2^14 elements a block on
    CPU (the loop costs nothing there), 2^22 on a GPU (a block is a few kernel launches)."""
    rows, cols = t.shape
    per = max(1, (1 << (14 if t.device.type == "cpu" else 22)) // max(cols, 1))
    return [(s, min(s + per, rows)) for s in range(0, rows, per)]


def bias_act_into(z, bias, activation, y, pre=None):
    """bias_act(z, bias, activation) written into y (and pre, when given), block by block."""
    for s, e in row_blocks(z):
        yb, pb = bias_act(z[s:e], bias, activation)
        y[s:e].copy_(yb)
        if pre is not None:
            pre[s:e].copy_(pb)
    return y


def act_backward_into(dy, pre, activation, out):
    """out = dy * act'(pre) (bias_act_backward's dz, in out's dtype), block by block. out may
    be dy itself: each block of dy is read before it is written."""
    for s, e in row_blocks(dy):
        out[s:e].copy_(bias_act_backward(dy[s:e], pre[s:e], activation)[0])
    return out


def norm_forward(x, weight, bias, eps, *, residual=None, residual_in_fp32=False, out_dtype=None, is_rms=False):
    """The 2-D core of layer_norm / rms_norm over the last dim.

    Returns (out, residual_sum or None, mean or None, rstd): mean (None for RMSNorm) and
    rstd in fp32 (float64 for float64 input), one per row.
    """
    ct = _compute_dtype(x)
    s = x.to(ct)
    residual_sum = None
    if residual is not None:
        s = s + residual.to(ct)
        # the unrounded sum is normalised; it is returned rounded to its storage dtype
        residual_sum = s.to(torch.float32 if residual_in_fp32 and ct == torch.float32 else x.dtype)
    if is_rms:
        mean = None
        rstd = torch.rsqrt(s.square().mean(-1, keepdim=True) + eps)
        y = s * rstd
    else:
        mean = s.mean(-1, keepdim=True)
        rstd = torch.rsqrt((s - mean).square().mean(-1, keepdim=True) + eps)
        y = (s - mean) * rstd
    if weight is not None:
        y = y * weight.to(ct)
    if bias is not None:
        y = y + bias.to(ct)
    out = y.to(out_dtype or x.dtype)
    return out, residual_sum, None if mean is None else mean.squeeze(-1), rstd.squeeze(-1)


def norm_backward(dy, x, weight, mean, rstd, *, dresidual_out=None, is_rms=False, want_dweight=True,
                  want_dbias=True, dx_dtype=None, param_dtype=None):
    """The 2-D core of the norms' backward, from what the forward saved.

    x: what was normalised (x, or the residual sum); mean (None for RMSNorm) and rstd per row.
    Returns (dx in dx_dtype, dweight or None, dbias or None): fp32 math (float64 for float64),
    dweight = sum(dy * xhat) and dbias = sum(dy) over rows, returned in param_dtype.
    dresidual_out, the gradient of the returned residual sum, is added to dx.
    """
    ct = _compute_dtype(x)
    n = x.shape[-1]
    xs, g0 = x.to(ct), dy.to(ct)
    r = rstd.to(ct).unsqueeze(-1)
    xhat = xs * r if is_rms else (xs - mean.to(ct).unsqueeze(-1)) * r
    g = g0 if weight is None else g0 * weight.to(ct)
    c1 = (g * xhat).sum(-1, keepdim=True) / n
    dx = (g - xhat * c1) * r if is_rms else (g - xhat * c1 - g.sum(-1, keepdim=True) / n) * r
    if dresidual_out is not None:
        dx = dx + dresidual_out.to(ct)
    param_dtype = param_dtype or (weight.dtype if weight is not None else x.dtype)
    dweight = (g0 * xhat).sum(0).to(param_dtype) if want_dweight else None
    dbias = g0.sum(0).to(param_dtype) if want_dbias else None
    return dx.to(dx_dtype or x.dtype), dweight, dbias


def _norm(x, normalized_shape, weight, bias, eps, residual, residual_in_fp32, out_dtype, is_rms):
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"normalized_shape {shape} does not match the last dims of x, shape {tuple(x.shape)}")
    n = math.prod(shape)
    flat = lambda t: None if t is None else t.reshape(-1, n)  # noqa: E731
    res = None if residual is None else residual.reshape(-1, n)
    out, residual_sum, _, _ = norm_forward(x.reshape(-1, n), flat(weight), flat(bias), eps, residual=res,
                                           residual_in_fp32=residual_in_fp32, out_dtype=out_dtype, is_rms=is_rms)
    out = out.reshape(x.shape)
    return out if residual is None else (out, residual_sum.reshape(x.shape))


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, residual=None, residual_in_fp32=False,
               out_dtype=None):
    """LayerNorm over the trailing `normalized_shape` dims; see the module docstring for dtypes."""
    return _norm(x, normalized_shape, weight, bias, eps, residual, residual_in_fp32, out_dtype, is_rms=False)


def default_rms_eps(dtype):
    """The eps torch's rms_norm uses when eps is None: the epsilon of its compute type
    (fp32 for fp16/bf16/fp32 inputs, fp64 for fp64), not of the input dtype."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def rms_norm(x, normalized_shape, weight=None, eps=None, *, residual=None, residual_in_fp32=False, out_dtype=None):
    """RMSNorm over the trailing dims; eps=None means default_rms_eps(x.dtype), as torch.nn.RMSNorm."""
    eps = default_rms_eps(x.dtype) if eps is None else eps
    return _norm(x, normalized_shape, weight, None, eps, residual, residual_in_fp32, out_dtype, is_rms=True)


def linear_act(x, weight, bias=None, activation="gelu_tanh"):
    """y = act(x @ weight.T + bias), accumulated in fp32 (float64 for float64), returned in x.dtype."""
    ct = _compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        z = F.linear(x.to(ct), weight.to(ct), None if bias is None else bias.to(ct))
    return act_fwd(z, activation).to(x.dtype)


def linear_cross_entropy(x, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    """cross_entropy(x @ weight.T + bias, target) written out: the logits rounded to x.dtype
    (as F.linear returns them), then log-softmax, the smoothed loss and the reduction in fp32
    (float64 for float64); mean over the tokens whose target is not ignore_index (NaN if none).
    Differentiable (autograd), for gradient references."""
    ct = _compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        z = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype)).to(ct)
    z = z.reshape(-1, z.shape[-1])
    t = target.reshape(-1)
    valid = t != ignore_index
    logp = torch.log_softmax(z, -1)
    nll = -logp.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1)
    per = (1 - label_smoothing) * nll - label_smoothing * logp.mean(-1) if label_smoothing else nll
    per = torch.where(valid, per, torch.zeros((), dtype=ct))
    if reduction == "none":
        return per.reshape(target.shape)
    return per.sum() if reduction == "sum" else per.sum() / valid.sum().to(ct)


GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")  # SwiGLU, GeGLU (erf), GeGLU (tanh)


def gated_act(g, u, activation):
    """act(g) * u in fp32 (float64 for float64), returned in g.dtype."""
    ct = _compute_dtype(g)
    return (act_fwd(g.to(ct), activation) * u.to(ct)).to(g.dtype)


def gated_act_backward(dh, g, u, activation):
    """(dg, du) = (dh * u * act'(g), dh * act(g)) in fp32, returned in dh.dtype."""
    ct = _compute_dtype(dh)
    dh32, g32 = dh.to(ct), g.to(ct)
    return (dh32 * u.to(ct) * act_grad(g32, activation)).to(dh.dtype), (dh32 * act_fwd(g32, activation)).to(dh.dtype)


def gated_act_into(gu, activation, out):
    """out = gated_act(g, u) for gu = [g | u] (M, 2H), block by block (no full-size fp32 temporaries)."""
    hidden = out.shape[1]
    for s, e in row_blocks(out):
        out[s:e].copy_(gated_act(gu[s:e, :hidden], gu[s:e, hidden:], activation))
    return out


def gated_act_backward_into(dh, gu, activation, out):
    """out = [dg | du] (M, 2H) from dh (M, H) and gu = [g | u], block by block; out may be gu
    itself (each block is read before it is written)."""
    hidden = dh.shape[1]
    for s, e in row_blocks(dh):
        dg, du = gated_act_backward(dh[s:e], gu[s:e, :hidden], gu[s:e, hidden:], activation)
        out[s:e, :hidden].copy_(dg)
        out[s:e, hidden:].copy_(du)
    return out


def gated_linear_act(x, gate_weight, up_weight, gate_bias=None, up_bias=None, activation="silu"):
    """act(x @ gate_weight.T + gate_bias) * (x @ up_weight.T + up_bias), accumulated in fp32
    (float64 for float64), returned in x.dtype."""
    ct = _compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        g = F.linear(x.to(ct), gate_weight.to(ct), None if gate_bias is None else gate_bias.to(ct))
        u = F.linear(x.to(ct), up_weight.to(ct), None if up_bias is None else up_bias.to(ct))
    return (act_fwd(g, activation) * u).to(x.dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotary_embedding(q, k, cos, sin, unsqueeze_dim=1):
    """Rotary position embedding, rotate-half form, as Hugging Face's apply_rotary_pos_emb computes
    it (in torch's promotion of the inputs' dtypes; fp64 inputs give the tests' reference)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
