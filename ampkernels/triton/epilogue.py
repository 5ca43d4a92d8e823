"""jit helpers shared by the linear_act kernels, the Triton ones (linear_act.py) and the Gluon
ping-pong kernel (linear_act_pingpong.py, whose Gluon functions call these): the activation
formulas forward and backward, and the order in which persistent programs walk output tiles."""
import os

import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Constants are literals inside the jit functions: compiled Triton reads only constexpr module
# globals, and the interpreter cannot multiply tensors by constexpr globals. 0.70710678 = 1/sqrt(2),
# 0.39894228 = 1/sqrt(2 pi), 0.79788456 = sqrt(2/pi), 0.044715: torch's tanh-GELU coefficient.
#
# The forward epilogue's activations are written as z / (1 + 2^t): one ex2 and one rcp (the SFU's
# approximate instructions, ~2 ulp of fp32) and a few FMAs, where the libdevice forms cost 11
# (silu), 19 (tanh GELU) and 31 (erf GELU) instructions an element more than ReLU (SASS for sm_90,
# 128x256 tile). That work runs after each tile's main loop, not beside it, so it is time the
# GEMM loses (docs/performance.md).
_FAST_MATH = tl.constexpr(not _INTERPRET)  # the interpreter has no inline PTX: exact exp2 and division


@triton.jit
def _exp2(x):
    # ftz: inputs below -126 give 0 instead of a denormal (their results round to 0 anyway)
    if _FAST_MATH:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _rcp(x):
    if _FAST_MATH:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def _gaussian_tail(a):
    # Q(a) = P(N(0,1) > a) for a >= 0, relative error < 3e-7 in float64 (fp32 evaluation: < 2.5e-6
    # for a < 6): Q = t 2^(p(t) - a^2 log2(e) / 2), t = 1 / (1 + 0.4 a), p a degree-8 polynomial
    # least-squares fitted to log2(Q(a) / t) + a^2 log2(e) / 2 over a in [0, 15] (beyond, Q < 2^-150).
    # No cancellation: the tail stays accurate where 1 + erf(x) loses all its digits in fp32.
    t = _rcp(1.0 + 0.4 * a)
    p = 0.27394530177116394
    p = p * t - 1.4028655290603638
    p = p * t + 2.8012568950653076
    p = p * t - 2.5152602195739746
    p = p * t + 0.7742717862129211
    p = p * t - 0.2584783434867859
    p = p * t + 0.5360429883003235
    p = p * t + 1.4386100769042969
    p = p * t - 2.6475226879119873
    return t * _exp2(p - 0.7213475204444817 * a * a)


@triton.jit
def _act_fwd(z, ACT: tl.constexpr):
    # z: fp32. NaN propagates (comparisons with NaN are False; 2^NaN is NaN); +inf gives +inf and
    # -inf NaN for the GELUs and SiLU, as torch's formulas give.
    if ACT == 1:  # relu (z <= 0 is False for NaN, so NaN propagates as in torch)
        z = tl.where(z <= 0.0, 0.0, z)
    elif ACT == 2:  # gelu (erf): z * Phi(z), Phi(z) = 1 - Q(z) for z >= 0, Q(-z) below
        q = _gaussian_tail(tl.abs(z))
        z = z * tl.where(z >= 0.0, 1.0 - q, q)
    elif ACT == 3:  # gelu_tanh: 0.5 z (1 + tanh(u)) = z / (1 + e^(-2u)), u = sqrt(2/pi) (z + 0.044715 z^3)
        z = z * _rcp(1.0 + _exp2(z * (-2.302208198 - 0.1029432396 * z * z)))  # -2 log2(e) sqrt(2/pi) (1, 0.044715)
    elif ACT == 4:  # silu: z / (1 + e^-z)
        z = z * _rcp(1.0 + _exp2(-1.4426950408889634 * z))
    elif ACT == 5:  # squared_relu
        r = tl.where(z <= 0.0, 0.0, z)
        z = r * r
    return z


@triton.jit
def _act_grad(z, ACT: tl.constexpr):
    # d act / dz in fp32 from the forward's ex2/rcp forms: within 2e-5 relative
    # + 1e-6 absolute of float64 (tests/test_linear_act.py, the formulas under the interpreter,
    # the SFU's on the GPU). NaN gives NaN (ReLU's mask gives 0, as the reference's), and so do
    # +-inf for the GELUs and SiLU (inf * 0), as torch's formulas give.
    if ACT == 0:
        g = tl.full(z.shape, 1.0, tl.float32)
    elif ACT == 1:
        g = tl.where(z > 0.0, 1.0, 0.0)
    elif ACT == 2:  # Phi(z) + z phi(z), Phi through the Gaussian tail, phi = 2^(-z^2 log2(e) / 2) / sqrt(2 pi)
        q = _gaussian_tail(tl.abs(z))
        g = tl.where(z >= 0.0, 1.0 - q, q) + z * 0.3989422804014327 * _exp2(-0.7213475204444817 * z * z)
    elif ACT == 3:  # with s = sigmoid(2u) (the forward's): 0.5 (1 + tanh u) = s, 1 - tanh^2 u = 4 s (1 - s)
        s = _rcp(1.0 + _exp2(z * (-2.302208198 - 0.1029432396 * z * z)))
        g = s + 2.0 * z * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
    elif ACT == 4:  # s (1 + z (1 - s)), s = sigmoid(z)
        s = _rcp(1.0 + _exp2(-1.4426950408889634 * z))
        g = s * (1.0 + z * (1.0 - s))
    else:  # squared relu: 2 relu(z)
        g = 2.0 * tl.where(z <= 0.0, 0.0, z)
    return g


@triton.jit
def _tile_origin(tile, num_m, num_n, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # (row, col) of a tile's first element: tiles walked in bands of GROUP_M tile rows, column
    # by column inside a band, so the programs in flight share x and W tiles in L2
    in_group = GROUP_M * num_n
    first_m = (tile // in_group) * GROUP_M
    group_size = min(num_m - first_m, GROUP_M)
    return (first_m + (tile % in_group) % group_size) * BLOCK_M, ((tile % in_group) // group_size) * BLOCK_N
