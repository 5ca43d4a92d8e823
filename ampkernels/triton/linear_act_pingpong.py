"""Hopper linear_act and gated_linear_act forwards with a warp-specialized "ping-pong" schedule,
written in Gluon.

Why: in the Triton TMA kernel (linear_act.py) every warp runs main loop, then epilogue. The erf
GELU and SiLU epilogues are long enough (tens of FP32/SFU instructions an element) that the
tensor cores sit idle through them; two programs per SM do not help, because programs that
start together stay in step. Here one program per SM holds three partitions:

    producer   (1 warp)   TMA loads of x and W tiles into a STAGES-deep shared-memory ring
    consumer 0 (4 warps)  the program's tiles 0, 2, 4, ...: wgmma main loop, then epilogue
    consumer 1 (4 warps)  tiles 1, 3, 5, ...

The consumers' main loops take turns (an mbarrier each), so while one runs its epilogue the
other has the tensor cores: the epilogue costs no GEMM time as long as it is shorter than a
main loop. Each consumer owns a 128 x 128 fp32 accumulator (128 registers a thread; 232-248
registers a thread after setmaxnreg, the producer gives its warpgroup's back).

The ring's ready/empty barriers are waited on by parity, which cannot tell phase n from n + 2;
the turns also keep the consumers meeting the phases in the order one consumer would.

Two more warpgroups taking the epilogue off the consumers, and a cooperative 256x128 kernel,
were slower at most shapes (docs/performance.md).

Gated (gated_linear_act_fwd_pingpong): the same schedule with BN = 64 output columns a tile; the
producer loads 64 rows of the gate's weight and the same 64 of the up projection's into the two
halves of a stage, so one 128-wide wgmma computes g and u side by side, and the epilogue pairs
them through shared memory: h = act(g) * u leaves over g's half (g and u first, when stored).

Same contract as _linear_act_fwd_tma_kernel: y = act(x W^T + b) with the pre-activation rounded
to y's dtype first (stored to pre when STORE_PRE), fp32 accumulation, the activation formulas and
the tile order of epilogue.py. Gluon has no interpreter; the kernel is compiled for sm_90 on CPU by
scripts/triton_compile_check.py and tested on the GPU (tests/test_linear_act.py,
tests/test_gated_linear_act.py).
"""
import functools

import torch

from . import cdiv
from .epilogue import _act_fwd, _tile_origin  # triton.jit functions: Gluon functions call them
from .launch import launch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                    warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon's Hopper API: the TMA kernel only
    gluon = None

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
# 5 x 32 KB of operand ring + 2 x 32 KB of output staging: 224 KB of the 227 KB (a fifth stage
# was 1-4% faster than four at most shapes)
STAGES = 5
GROUP_M = 8
# registers a thread: 168 at launch (12 warps x 32 x 168 <= 64 K); after setmaxnreg the producer's
# warpgroup keeps 24, consumer 1 takes 232 and consumer 0 what is left (248)
MAXNREG, CONSUMER_REGS, PRODUCER_REGS = 168, 232, 24


def available():
    return gluon is not None


if gluon is not None:
    _GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}

    @gluon.jit
    def _producer(x_desc, w_desc, w2_desc, y_desc, pre_desc, pre2_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn,
                  b_ptr, b2_ptr, M, N, K, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_BIAS2: gl.constexpr,
                  STORE_PRE: gl.constexpr, GROUP: gl.constexpr):
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]  # output columns a tile
        GATED: gl.constexpr = b_bufs.type.shape[1] != BN  # see _pingpong_kernel
        WEIGHTS: gl.constexpr = 2 if GATED else 1  # weight tiles a ring slot holds
        NSTAGE: gl.constexpr = a_bufs.type.shape[0]
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        k_tiles = gl.cdiv(K, BK)
        count = 0  # ring slots filled so far, over all of this program's tiles
        for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            off_m, off_n = _tile_origin(tile, num_m, num_n, GROUP, BM, BN)
            for kk in range(k_tiles):
                slot = count % NSTAGE
                mbarrier.wait(empty.index(slot), ((count // NSTAGE) & 1) ^ 1)  # the first pass finds it free
                # out-of-bounds rows and the K tail are zero-filled by TMA
                mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes + WEIGHTS * w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [off_m, kk * BK], ready.index(slot), a_bufs.index(slot))
                if GATED:  # the gate's rows over the slot's first half, the up projection's over the second
                    b_slot = b_bufs.index(slot)
                    tma.async_copy_global_to_shared(w_desc, [off_n, kk * BK], ready.index(slot), b_slot.slice(0, BN))
                    tma.async_copy_global_to_shared(w2_desc, [off_n, kk * BK], ready.index(slot), b_slot.slice(BN, BN))
                else:
                    tma.async_copy_global_to_shared(w_desc, [off_n, kk * BK], ready.index(slot), b_bufs.index(slot))
                count += 1

    @gluon.jit
    def _mma_k_loop(a_bufs, b_bufs, ready, empty, acc, count, k_tiles):
        """acc += the program's next k_tiles ring slots' a @ b^T, from ring slot count on; each
        slot is released (an arrival on empty) once the MMA after it has been issued, the last
        one left to the caller (it waits for the final MMA first). Returns (acc, count)."""
        NSTAGE: gl.constexpr = a_bufs.type.shape[0]
        for kk in range(k_tiles):
            slot = count % NSTAGE
            mbarrier.wait(ready.index(slot), (count // NSTAGE) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            # the MMA before this one is done reading its slot: hand the slot back to the producer
            mbarrier.arrive(empty.index((count + NSTAGE - 1) % NSTAGE), count=1, pred=kk > 0)
            count += 1
        return acc, count

    @gluon.jit
    def _act_epilogue(acc, c_smem, off_m, off_n, y_desc, pre_desc, b_ptr, N, ACT: gl.constexpr,
                      HAS_BIAS: gl.constexpr, STORE_PRE: gl.constexpr):
        """y = act(acc + b) (and pre = acc + b when STORE_PRE) through c_smem to y (and pre)."""
        BN: gl.constexpr = acc.type.shape[1]
        dtype: gl.constexpr = y_desc.dtype
        acc_layout: gl.constexpr = acc.type.layout
        # the bias load is masked off without a bias rather than left out: Triton 3.6 fails to
        # lower a partition that never uses b_ptr (an assertion in ConvertTritonGPUToLLVM)
        offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
        acc = acc + gl.load(b_ptr + offs_n, mask=(offs_n < N) & HAS_BIAS, other=0.0).to(gl.float32)[None, :]
        pre = acc.to(dtype)  # rounded as the unfused path (GEMM, then act) rounds it
        tma.store_wait(0)  # this consumer's previous tile has left c_smem
        if STORE_PRE:
            # pre leaves from shared memory, then the activation reads it back in column halves and
            # writes in place: acc, pre and the erf GELU's temporaries at once spill (ptxas: 800 bytes).
            # 8 contiguous elements (16 bytes) a thread.
            half_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BN // 16), BN // 16], [4, 1], [1, 0])
            c_smem.store(pre)
            fence_async_shared()
            tma.async_copy_shared_to_global(pre_desc, [off_m, off_n], c_smem)
            tma.store_wait(0)
            for h in gl.static_range(2):
                half = c_smem.slice(h * (BN // 2), BN // 2, dim=1)
                half.store(_act_fwd(half.load(half_layout).to(gl.float32), ACT).to(dtype))
        else:
            c_smem.store(_act_fwd(pre.to(gl.float32), ACT).to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(y_desc, [off_m, off_n], c_smem)  # rows/cols past M/N clipped

    @gluon.jit
    def _gated_epilogue(acc, c_smem, off_m, off_n, h_desc, g_desc, u_desc, bg_ptr, bu_ptr, H,
                        ACT: gl.constexpr, HAS_BG: gl.constexpr, HAS_BU: gl.constexpr, STORE: gl.constexpr):
        """acc (BM, 2 BN): g in its first BN columns, u in the rest. g and u (biased, rounded to
        h's dtype) go to shared memory (and from there to gu when STORE); h = act(g) * u is
        computed from there a half of the rows at a time and leaves over g's half."""
        BM: gl.constexpr = acc.type.shape[0]
        BN: gl.constexpr = acc.type.shape[1] // 2
        dtype: gl.constexpr = h_desc.dtype
        acc_layout: gl.constexpr = acc.type.layout
        cols = gl.arange(0, 2 * BN, layout=gl.SliceLayout(0, acc_layout))
        col = off_n + cols % BN
        is_up = cols >= BN
        # masked loads rather than none without a bias (Triton 3.6 cannot lower an unused pointer)
        bias = gl.where(is_up, gl.load(bu_ptr + col, mask=is_up & (col < H) & HAS_BU, other=0.0).to(gl.float32),
                        gl.load(bg_ptr + col, mask=(cols < BN) & (col < H) & HAS_BG, other=0.0).to(gl.float32))
        gu = (acc + bias[None, :]).to(dtype)  # rounded as the unfused path's GEMM rounds g and u
        tma.store_wait(0)  # this consumer's previous tile has left c_smem
        c_smem.store(gu)
        g_half = c_smem.slice(0, BN, dim=1)
        u_half = c_smem.slice(BN, BN, dim=1)
        if STORE:
            fence_async_shared()
            tma.async_copy_shared_to_global(g_desc, [off_m, off_n], g_half)
            tma.async_copy_shared_to_global(u_desc, [off_m, off_n], u_half)
            tma.store_wait(1)  # g's half has been read out: h may go over it
        # 8 contiguous elements (16 bytes) a thread; each thread writes h where it read g
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BN // 8), BN // 8], [4, 1], [1, 0])
        for r in gl.static_range(2):
            g_rows = g_half.slice(r * (BM // 2), BM // 2, dim=0)
            g = g_rows.load(layout).to(gl.float32)
            u = u_half.slice(r * (BM // 2), BM // 2, dim=0).load(layout).to(gl.float32)
            g_rows.store((_act_fwd(g, ACT) * u).to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(h_desc, [off_m, off_n], g_half)  # rows/cols past M/H clipped

    @gluon.jit
    def _consumer(x_desc, w_desc, w2_desc, y_desc, pre_desc, pre2_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn,
                  b_ptr, b2_ptr, M, N, K, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_BIAS2: gl.constexpr,
                  STORE_PRE: gl.constexpr, GROUP: gl.constexpr, PARITY: gl.constexpr):
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]  # output columns a tile
        MMA_N: gl.constexpr = b_bufs.type.shape[1]  # BN, or 2 BN gated (gate and up)
        GATED: gl.constexpr = MMA_N != BN
        NSTAGE: gl.constexpr = a_bufs.type.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, MMA_N, 16])
        c_smem = c_bufs.index(PARITY)
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        k_tiles = gl.cdiv(K, BK)
        programs = gl.num_programs(0)
        local = PARITY  # this tile's index among the program's tiles
        for tile in range(gl.program_id(0) + PARITY * programs, num_m * num_n, 2 * programs):
            off_m, off_n = _tile_origin(tile, num_m, num_n, GROUP, BM, BN)
            count = local * k_tiles
            # wait for the other consumer's previous main loop to have been issued
            j = local // 2
            if PARITY == 0:
                mbarrier.wait(turn.index(0), (j - 1) & 1, pred=j > 0)
            else:
                mbarrier.wait(turn.index(1), j & 1)
            acc = gl.zeros((BM, MMA_N), dtype=gl.float32, layout=acc_layout)
            acc, count = _mma_k_loop(a_bufs, b_bufs, ready, empty, acc, count, k_tiles)
            mbarrier.arrive(turn.index(1 - PARITY), count=1)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((count + NSTAGE - 1) % NSTAGE), count=1)
            local += 2
            if GATED:
                _gated_epilogue(acc, c_smem, off_m, off_n, y_desc, pre_desc, pre2_desc, b_ptr, b2_ptr, N, ACT,
                                HAS_BIAS, HAS_BIAS2, STORE_PRE)
            else:
                _act_epilogue(acc, c_smem, off_m, off_n, y_desc, pre_desc, b_ptr, N, ACT, HAS_BIAS, STORE_PRE)
        tma.store_wait(0)

    @gluon.jit
    def _consumer0(x_desc, w_desc, w2_desc, y_desc, pre_desc, pre2_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn,
                   b_ptr, b2_ptr, M, N, K, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_BIAS2: gl.constexpr,
                   STORE_PRE: gl.constexpr, GROUP: gl.constexpr):
        _consumer(x_desc, w_desc, w2_desc, y_desc, pre_desc, pre2_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn,
                  b_ptr, b2_ptr, M, N, K, ACT, HAS_BIAS, HAS_BIAS2, STORE_PRE, GROUP, 0)

    @gluon.jit
    def _consumer1(x_desc, w_desc, w2_desc, y_desc, pre_desc, pre2_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn,
                   b_ptr, b2_ptr, M, N, K, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_BIAS2: gl.constexpr,
                   STORE_PRE: gl.constexpr, GROUP: gl.constexpr):
        _consumer(x_desc, w_desc, w2_desc, y_desc, pre_desc, pre2_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn,
                  b_ptr, b2_ptr, M, N, K, ACT, HAS_BIAS, HAS_BIAS2, STORE_PRE, GROUP, 1)

    @gluon.jit
    def _pingpong_kernel(x_desc, w_desc, w2_desc, y_desc, pre_desc, pre2_desc, b_ptr, b2_ptr, M, N, K,
                         ACT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_BIAS2: gl.constexpr, STORE_PRE: gl.constexpr,
                         GROUP: gl.constexpr, GATED: gl.constexpr, NSTAGE: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """linear_act (GATED False: w2/pre2/b2 unused) or gated_linear_act (GATED: w and w2 the gate
        and up weights, y = h, pre and pre2 the g and u halves of gu, b and b2 their biases)."""
        dtype: gl.constexpr = x_desc.dtype
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        MMA_N: gl.constexpr = w_desc.block_type.shape[0] * (2 if GATED else 1)
        a_bufs = gl.allocate_shared_memory(dtype, [NSTAGE, BM, BK], x_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [NSTAGE, MMA_N, BK], w_desc.layout)
        c_bufs = gl.allocate_shared_memory(dtype, [2, BM, MMA_N], y_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NSTAGE):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        # the flags reach the partitions as values, not constexprs (an assigned tuple's constexprs
        # become tensors; the compiled code still folds them): GATED, which changes types, is read
        # off the buffers' shapes there
        args = (x_desc, w_desc, w2_desc, y_desc, pre_desc, pre2_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn,
                b_ptr, b2_ptr, M, N, K, ACT, HAS_BIAS, HAS_BIAS2, STORE_PRE, GROUP)
        gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_producer, args)], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])

    @functools.lru_cache(None)
    def _smem_layout(dtype, rows, cols):
        return gl.NVMMASharedLayout.get_default_for([rows, cols], _GL_DTYPES[dtype])


def _desc(t, rows, cols):
    return TensorDescriptor.from_tensor(t, [rows, cols], _smem_layout(t.dtype, rows, cols))


def linear_act_fwd_pingpong(x, weight, bias, act_id, y, pre, programs, block_k=BLOCK_K, stages=STAGES,
                            group=GROUP_M):
    """y = act(x W^T + b) into y (and x W^T + b into pre when pre is not None); x (M, K), weight
    (N, K), y/pre (M, N), 16-bit, one dtype, TMA-ready (linear_act._tma_ok); M, N, K > 0.
    programs: SMs to use (one program each). block_k / stages / group: the K step, the operand
    ring's depth and the tile walk's band height; the library runs the defaults (parameters for
    tuning runs)."""
    M, K = x.shape
    N = weight.shape[0]
    w_desc, y_desc = _desc(weight, BLOCK_N, block_k), _desc(y, BLOCK_M, BLOCK_N)
    pre_desc = _desc(pre, BLOCK_M, BLOCK_N) if pre is not None else y_desc
    b = bias if bias is not None else x
    grid = (min(programs, cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)),)
    launch(_pingpong_kernel, grid, _desc(x, BLOCK_M, block_k), w_desc, w_desc, y_desc, pre_desc, pre_desc, b, b,
           M, N, K, ACT=act_id, HAS_BIAS=bias is not None, HAS_BIAS2=False, STORE_PRE=pre is not None, GROUP=group,
           GATED=False, NSTAGE=stages, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4,
           maxnreg=MAXNREG)


def gated_linear_act_fwd_pingpong(x, wg, wu, bg, bu, act_id, h, gu, programs, stages=STAGES, group=GROUP_M):
    """h = act(x Wg^T + bg) * (x Wu^T + bu) into h (M, H), and g, u into gu = [g | u] (M, 2H) when
    gu is not None; x (M, K), wg and wu (H, K), 16-bit, one dtype, TMA-ready (gu's halves too);
    M, H, K > 0. A tile: BLOCK_N / 2 columns of h, its main loop one BLOCK_N-wide MMA over the
    gate's and the up projection's rows side by side in shared memory (the weights need not be
    packed)."""
    M, K = x.shape
    H = wg.shape[0]
    half = BLOCK_N // 2
    h_desc = _desc(h, BLOCK_M, half)
    g_desc, u_desc = (_desc(gu[:, :H], BLOCK_M, half), _desc(gu[:, H:], BLOCK_M, half)) if gu is not None \
        else (h_desc, h_desc)
    grid = (min(programs, cdiv(M, BLOCK_M) * cdiv(H, half)),)
    launch(_pingpong_kernel, grid, _desc(x, BLOCK_M, BLOCK_K), _desc(wg, half, BLOCK_K), _desc(wu, half, BLOCK_K),
           h_desc, g_desc, u_desc, bg if bg is not None else x, bu if bu is not None else x, M, H, K, ACT=act_id,
           HAS_BIAS=bg is not None, HAS_BIAS2=bu is not None, STORE_PRE=gu is not None, GROUP=group, GATED=True,
           NSTAGE=stages, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG)
