"""The kernels of both op families, forward and backward, on boundary shapes and dtype mixes,
for compute-sanitizer (scripts/sanitize.sh). Small row counts keep racecheck's run short.

    [SANITIZER_DTYPES="bfloat16 float16"] [SANITIZER_OPS="norms norm_mixes linear_act mlp gated lce rotary"] \
        [SANITIZER_SHARD=K/N] [SANITIZER_CASES=regex] python scripts/sanitize_cases.py [cuda] [triton] [torch]

Every output and gradient is checked against float64 autograd with the tests' checks
(tests/test_dtype_combos.check_norm, tests/test_fuzz.check_linear_act / check_mlp: values,
dtypes, inputs unmodified); a wrong result exits non-zero, so an uninitialised-read report on
an output that matches the reference points at the tool.
"torch" runs the same cases through eager PyTorch: a control for reports that stem from
cuBLAS's own kernels or the tool rather than from ours.

What the cases cover (N at the edges of each kernel's regime; see csrc/layer_norm.cu and
ampkernels/triton/layer_norm.py):
- norms, CUDA: the register-tile forward up to 512 threads x 4 vectors (N = 16384 at 16 bits
  with 16-byte vectors, 2048 with one-element vectors: N odd) and the looped forward past it
  (16392, 2049); the pipelined backward (16-bit x, N % 8 == 0, up to 16384; its shared memory
  with a 16-bit dresidual_out fits to N = 14336, not 14344), the register-tile backward (fp32 or
  odd N, up to 2048 one-element vectors) and the looped backward (16392, 2049); rows of 1, 3 and
  300 (several rows per persistent block).
- norms, Triton: the register forward up to BLOCK_N 16384 and the chunked forward (16385; with
  16-bit params RMSNorm from 8193, LayerNorm at 16384); the backward's register kernel up to
  8192, RELOAD to 16384, the looped kernel past it; on sm_80+ the rows from 4096 once more with
  the Gluon kernels at every row length they take (SANITIZER_GLUON=0 skips that).
- norm_mixes, the norms' dtype mixes: a pairwise cover of tests/test_dtype_combos.py's grid and issue 31's
  crash (16-bit x, fp32 residual kept in fp32, 16-bit weight/bias) by name.
- linear_act: on Hopper first two Gluon warp_specialize kernels (a minimal one and one with the
  ping-pong GEMM's warps and registers), controls for racecheck's reports on the ping-pong GEMM
  (docs/reliability.md); the dz pass (act' backward and the dbias
  partials; tiles of 64 x 128 on a GPU: M, N at 63/65 and 127/129), the pointer and TMA
  forwards, on Hopper the ping-pong GEMM (AMPKERNELS_TRITON_AUTOTUNE=0 makes it the TMA-ready
  shapes' kernel: K and N multiples of 8; more tiles than SMs, so each consumer runs several),
  autocast with fp32 master weights.
- mlp: fused_mlp's backward (act' in place on its own dh), TMA-ready shapes and not.
- gated: gated_linear_act's forward epilogue and fused backward, packed weights and not; on
  Hopper the gated ping-pong forward (TMA-ready shapes, one with more tiles than SMs).
- lce: linear_cross_entropy's row pass, drawn cases (tests/test_fuzz.lce_case) at row lengths
  around the kernels' block sizes.
- rotary: rotary_embedding's forward and backward (tests/test_rotary._check) at head dims whose
  half is not a power of two, the smallest and the largest, GQA, both layouts (q and k strided),
  fp32 and 16-bit cos/sin of batch 1 or B, an fp32 out_dtype.
The cases run inside a function so that every tensor is freed before the process exits:
memcheck's leak check would otherwise count the module-level tensors still alive at exit.
"""
import gc
import os
import sys
import re
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the tests' checks

from tests.test_dtype_combos import ISSUE_31, NormCombo, check_combo, norm_combos, pairwise  # noqa: E402
from tests.test_fuzz import check_linear_act, check_mlp, lce_case, tensor  # noqa: E402
from tests.test_gated_linear_act import _check as check_gated, _inputs as gated_inputs  # noqa: E402
from tests.test_rotary import _check as check_rotary, _inputs as rotary_inputs  # noqa: E402

import ampkernels  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: "torch" only, to try the script
F32 = torch.float32
CASES = [0]
SEEN = [0]
# SANITIZER_SHARD="K/N" (as pytest's --shard in tests/conftest.py): run every N-th case from the
# K-th (the kernels and shapes of a split family are the same; the random data differs, as the
# skipped cases' checks draw none)
SHARD_K, SHARD_N = (int(v) for v in (os.environ.get("SANITIZER_SHARD") or "1/1").split("/"))
# SANITIZER_CASES: a regular expression; only the cases whose names it finds run (then sharded),
# e.g. "2050x" for the largest shapes, which need more time under a tool than the others together
CASE_FILTER = re.compile(os.environ.get("SANITIZER_CASES") or "")


def case(name, fn, *args, **kw):
    if not CASE_FILTER.search(name):
        return
    SEEN[0] += 1
    if (SEEN[0] - 1) % SHARD_N != SHARD_K - 1:
        return
    print(f"case {CASES[0]}: {name}", flush=True)  # where a process the tool kills had got to
    try:
        fn(*args, **kw)
    except Exception as e:  # a wrong result or a kernel error: the run fails, naming the case
        sys.exit(f"sanitize case {name}: {type(e).__name__}: {e}")
    CASES[0] += 1


# (N, rows): the regime edges above; rows of 300 at 1000 and 4096 give a persistent block several rows
NORM_SHAPES = [(1, 3), (7, 3), (1000, 1), (1000, 300), (2048, 3), (2049, 3), (4096, 300), (8192, 3), (8193, 3),
               (14336, 2), (14344, 2), (16384, 2), (16385, 2), (16392, 2)]


def norm_cases(backend, dtype, min_n=0):
    """The regime edges from min_n up, each with three dtype combinations."""
    for n, rows in (s for s in NORM_SHAPES if s[0] >= min_n):
        for is_rms in (False, True):
            # fp32 params, 16-bit params, each with a residual in x's dtype (the pipelined
            # backward's dresidual_out) or fp32 kept in fp32 (an fp32 saved sum)
            in_fp32 = n < 16  # a 16-bit stored sum of a few elements: a known error (test_dtype_combos)
            for combo in (NormCombo(is_rms, dtype, dtype, in_fp32, F32, F32),
                          NormCombo(is_rms, dtype, F32, True, dtype, dtype),
                          NormCombo(is_rms, dtype, None, False, dtype, None, F32)):
                case(f"{backend} {combo} {rows}x{n}", check_combo, combo, backend, n, rows, dev)


def norm_mix_cases(backend, dtype):
    """The dtype mixes (fp32 x's with the first dtype only: SANITIZER_DTYPES' second pass would
    repeat most of them) and issue 31's crash cases."""
    for is_rms in (False, True):  # dtype mixes: every pair of factor values, at an odd N or a 16-bit aligned one
        for x_dtype in (dtype, F32) if dtype == _dtypes()[0] else (dtype,):
            for i, combo in enumerate(pairwise(norm_combos(is_rms, x_dtype, (dtype, F32)))):
                n = (1000, 2560)[i % 2]
                case(f"{backend} {combo} 3x{n}", check_combo, combo, backend, n, 3, dev)
    for combo in ISSUE_31:
        if combo.x == dtype:
            case(f"{backend} issue 31 {combo}", check_combo, combo, backend, 2560, 4, dev)


def _t(shape, dtype, layout="contiguous", scale=1.0):
    return tensor(shape, dtype, dev, None, layout, scale)


def _activations(backend, every):
    """Every activation, or for Triton away from `every` shape one: each activation is a kernel of
    its own for Triton's JIT (compiling them all at every shape took the whole call), while the
    indexing under test does not depend on it."""
    return ampkernels.ACTIVATIONS if backend != "triton" or every else ("gelu_tanh",)


def _ws_controls():
    """Two Gluon warp_specialize kernels whose partitions share no memory and write disjoint
    ranges of out, or [] without Gluon's Hopper API: any racecheck report on them comes from the
    lowering's own handshake (the switch loop's partition state), not from a kernel's buffers.
    The minimal one has one worker warp; the ping-pong-shaped one has the ping-pong GEMM's warps
    (4 default, workers of 4 and 1, 12 in the block), register split and in-partition barriers."""
    from ampkernels.triton import linear_act_pingpong as pp
    if not pp.available():
        return []
    gluon, gl = pp.gluon, pp.gl

    @gluon.jit
    def _ws_part(out, START: gl.constexpr, WARPS: gl.constexpr):
        offs = gl.arange(0, 32 * WARPS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
        gl.store(out + START + offs, offs + START)
        gl.thread_barrier()  # a barrier within the partition, as the GEMM's consumers have
        gl.store(out + START + offs, offs + START + 1)

    @gluon.jit
    def _ws_minimal_kernel(out):
        gl.warp_specialize([(_ws_part, (out, 0, 4)), (_ws_part, (out, 128, 1))], [1], [24])

    @gluon.jit
    def _ws_pingpong_shaped_kernel(out, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        gl.warp_specialize([(_ws_part, (out, 0, 4)), (_ws_part, (out, 128, 4)), (_ws_part, (out, 256, 1))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    def check(launch, n):
        out = torch.zeros(n, dtype=torch.int32, device=dev)
        launch(out)
        assert torch.equal(out, torch.arange(1, n + 1).to(out)), "warp_specialize control: wrong output"

    return [("minimal", lambda: check(lambda out: _ws_minimal_kernel[(2,)](out, num_warps=4), 160)),
            ("ping-pong-shaped", lambda: check(lambda out: _ws_pingpong_shaped_kernel[(2,)](
                out, CONSUMER_REGS=pp.CONSUMER_REGS, PRODUCER_REGS=pp.PRODUCER_REGS, num_warps=4,
                maxnreg=pp.MAXNREG), 288))]


def linear_act_cases(backend, dtype):
    if backend == "triton" and dev == "cuda" and torch.cuda.get_device_capability()[0] == 9:
        for name, control in _ws_controls():  # before the ping-pong GEMM's cases
            case(f"triton gluon warp_specialize control, {name}", control)
    shapes = [(1, 13, 7), (5, 64, 24), (33, 13, 8), (63, 40, 127), (65, 72, 129), (70, 136, 200),
              (129, 72, 136), (2050, 64, 1032)]  # the last: 153 tiles of 128 x 128, more than an H200's SMs
    for m, k, n in shapes:
        for activation in _activations(backend, (m, k, n) == (65, 72, 129)):
            for bias in (True, False):
                for autocast in ((False, True) if dev == "cuda" and bias and m < 2000 else (False,)):
                    pdtype = F32 if autocast else dtype
                    x, w = _t((m, k), dtype), _t((n, k), pdtype, scale=k ** -0.5)
                    b = _t((n,), pdtype) if bias else None
                    case(f"{backend} linear_act {activation} bias={bias} autocast={autocast} {dtype} {m}x{k}x{n}",
                         check_linear_act, x, w, b, activation, backend, dtype, autocast)


def mlp_cases(backend, dtype):
    # fused_mlp's backward applies act' in place on its own dh (act_backward_cuda_, Triton out=dy)
    for (m, k, h, n) in ((1, 16, 40, 16), (33, 13, 8, 13), (70, 64, 200, 64), (130, 64, 136, 72)):
        for activation in _activations(backend, m == 70):
            t = lambda *s: _t(s, dtype, scale=0.5)  # noqa: E731
            case(f"{backend} fused_mlp {activation} {dtype} {m}x{k}x{h}x{n}", check_mlp,
                 t(m, k), t(h, k), t(h), t(n, h), t(n), activation, backend, dtype)


def gated_cases(backend, dtype):
    # the gated GEMM's epilogue (g, u and h stores at the tile edges), the packed one-GEMM path,
    # the fused backward written over the saved g|u buffer; on Hopper the last two shapes are the
    # ping-pong kernel's (TMA-ready), the last with more tiles than SMs
    for (m, k, h) in ((1, 13, 7), (33, 40, 65), (65, 72, 129), (130, 64, 136), (2050, 64, 1032)):
        for activation in (ampkernels.ops.gated_linear_act.ACTIVATIONS if backend != "triton" or m == 65
                           else ("silu",)):
            for packed, biases in ((False, (True, True)), (True, (False, False)), (False, (False, True))):
                ins = gated_inputs(m, k, h, dtype, dev, biases, packed=packed)
                case(f"{backend} gated_linear_act {activation} packed={packed} biases={biases} {dtype} {m}x{k}x{h}",
                     check_gated, *ins, activation, backend)


def lce_cases(backend, dtype):
    # linear_cross_entropy's row pass (online max/sum over blocks of a row, the gradient written
    # in place over the logits) at row lengths around its block sizes, several chunks per call
    import random
    rng, gen = random.Random(31), torch.Generator().manual_seed(31)
    for i in range(12):
        params = {}
        case(f"{backend} linear_cross_entropy #{i} {dtype}", lambda: lce_case(
            rng, gen, params, backend, dev, (dtype,), (7, 300, 1001, 2048, 4100)))


def rotary_cases(backend, dtype):
    # (batch, q heads, k heads, positions, head dim)
    for (b, hq, hk, s, d) in ((1, 1, 1, 1, 2), (2, 3, 1, 33, 6), (1, 5, 5, 9, 128), (2, 2, 2, 3, 256),
                              (2, 8, 2, 70, 64)):
        for layout in ("bhsd", "bshd"):
            for cs_dtype, cos_batch in ((F32, 1), (dtype, b)):
                ins = rotary_inputs(b, hq, hk, s, d, dtype, cs_dtype, layout, cos_batch, device=dev)
                case(f"{backend} rotary {layout} cos/sin {cs_dtype} batch {cos_batch} {dtype} {b}x{hq}/{hk}x{s}x{d}",
                     check_rotary, backend, *ins)
    ins = rotary_inputs(2, 4, 2, 17, 64, dtype, F32, "bhsd", 2, device=dev)
    case(f"{backend} rotary out_dtype float32 {dtype}", check_rotary, backend, *ins, out_dtype=F32)


def _gluon_on(backend):
    """Whether the Triton norms run a second time with the Gluon kernels on (SANITIZER_GLUON=0: no)."""
    if backend != "triton" or dev != "cuda" or os.environ.get("SANITIZER_GLUON", "1") == "0":
        return False
    from ampkernels.triton import layer_norm as tln
    return tln._gluon.available() and torch.cuda.get_device_capability()[0] >= 8


def _dtypes():
    return [getattr(torch, d) for d in (os.environ.get("SANITIZER_DTYPES") or "float16 bfloat16").split()]


def main(backends):
    torch.manual_seed(0)
    ops = os.environ.get("SANITIZER_OPS", "norms norm_mixes linear_act mlp gated lce rotary").split()
    for backend in backends:
        for dtype in _dtypes():
            if "norms" in ops:
                norm_cases(backend, dtype)
                if _gluon_on(backend):  # the Gluon kernels' rows (forward from 4104, backward from 8193)
                    from ampkernels.triton import layer_norm as tln
                    saved, tln.GLUON_MIN_N = tln.GLUON_MIN_N, dict.fromkeys(tln.GLUON_MIN_N, 0)
                    norm_cases(backend, dtype, min_n=4096)
                    tln.GLUON_MIN_N = saved
            if "norm_mixes" in ops:
                norm_mix_cases(backend, dtype)
            if "linear_act" in ops:
                linear_act_cases(backend, dtype)
            if "mlp" in ops:
                mlp_cases(backend, dtype)
            if "gated" in ops:
                gated_cases(backend, dtype)
            if "lce" in ops:
                lce_cases(backend, dtype)
            if "rotary" in ops:
                rotary_cases(backend, dtype)
        if dev == "cuda":
            torch.cuda.synchronize()
        print(f"sanitize cases done: {backend} ({CASES[0]} cases so far)", flush=True)


def _describe(obj):
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_name} ({os.path.basename(obj.f_code.co_filename)}:{obj.f_lineno})"
    if isinstance(obj, dict) and "__name__" in obj:
        return f"dict (globals of {obj['__name__']})"
    return type(obj).__name__


def report_alive():
    """The CUDA tensors Python still holds at exit, which memcheck's leak list includes (under
    PYTORCH_NO_CUDA_MEMORY_CACHING torch keeps no allocation statistics: memory_allocated reads 0):
    what refers to each, and for the frames among those (a frame outlives its call only while
    something holds it) the chain of referrers up from the frame to what keeps it."""
    gc.collect()
    torch.cuda.synchronize()
    live = [t for t in gc.get_objects() if torch.is_tensor(t) and t.is_cuda]
    print(f"sanitize cases: {len(live)} CUDA tensors alive at exit, "
          f"{sum(t.untyped_storage().nbytes() for t in live)} bytes", flush=True)
    frames, made = [], []  # made: the lists this function makes, kept alive so that their ids stay theirs
    own = {id(live), id(frames), id(made), id(sys._getframe())}  # its own references, left out below

    def referrers(obj):
        refs = gc.get_referrers(obj)
        kept = [r for r in refs if id(r) not in own]
        made.extend((refs, kept))
        own.update((id(refs), id(kept)))
        return kept

    for i in range(min(len(live), 12)):
        holders = referrers(live[i])
        frames += [r for r in holders if isinstance(r, types.FrameType) and r not in frames]
        print(f"  alive: {tuple(live[i].shape)} {live[i].dtype} held by {[_describe(r) for r in holders[:6]]}",
              flush=True)
    del frames[3:]
    for frame in frames:
        chain, obj = [], frame
        for _ in range(8):  # up the referrers that are not frames (a callee's f_back refers to its caller)
            obj = next((r for r in referrers(obj) if not isinstance(r, types.FrameType)), None)
            if obj is None:
                break
            chain.append(_describe(obj))
        why = " <- ".join(chain) or "frames only (its callees' f_back), or nothing Python sees"
        print(f"  {_describe(frame)} kept by: {why}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["cuda", "triton"])
    if dev == "cuda":
        report_alive()
