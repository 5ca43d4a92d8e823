"""Hopper linear_act forward with a warp-specialized "ping-pong" schedule, written in Gluon.

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

Same contract as _linear_act_fwd_tma_kernel: y = act(x W^T + b) with the pre-activation rounded
to y's dtype first (stored to pre when STORE_PRE), fp32 accumulation, the activation formulas and
the tile order of epilogue.py. Gluon has no interpreter; the kernel is compiled for sm_90 on CPU by
scripts/triton_compile_check.py and tested on the GPU (tests/test_linear_act.py).
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
    def _producer(x_desc, w_desc, y_desc, pre_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, b_ptr, M, N, K,
                  ACT: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_PRE: gl.constexpr, GROUP: gl.constexpr):
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
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
                mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
                # out-of-bounds rows and the K tail are zero-filled by TMA
                tma.async_copy_global_to_shared(x_desc, [off_m, kk * BK], ready.index(slot), a_bufs.index(slot))
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
    def _consumer(x_desc, w_desc, y_desc, pre_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, b_ptr, M, N, K,
                  ACT: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_PRE: gl.constexpr, GROUP: gl.constexpr,
                  PARITY: gl.constexpr):
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        NSTAGE: gl.constexpr = a_bufs.type.shape[0]
        dtype: gl.constexpr = x_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 16])
        # 8 contiguous elements (16 bytes) a thread for the in-place activation pass over shared memory
        half_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BN // 16), BN // 16], [4, 1], [1, 0])
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
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
            acc, count = _mma_k_loop(a_bufs, b_bufs, ready, empty, acc, count, k_tiles)
            mbarrier.arrive(turn.index(1 - PARITY), count=1)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((count + NSTAGE - 1) % NSTAGE), count=1)
            local += 2

            # the bias load is masked off without a bias rather than left out: Triton 3.6 fails to
            # lower a partition that never uses b_ptr (an assertion in ConvertTritonGPUToLLVM)
            offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
            acc = acc + gl.load(b_ptr + offs_n, mask=(offs_n < N) & HAS_BIAS, other=0.0).to(gl.float32)[None, :]
            pre = acc.to(dtype)  # rounded as the unfused path (GEMM, then act) rounds it
            tma.store_wait(0)  # this consumer's previous tile has left c_smem
            if STORE_PRE:
                # pre leaves from shared memory, then the activation reads it back in column
                # halves and writes in place: acc, pre and the erf GELU's temporaries at once
                # spill (ptxas: 800 bytes)
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
        tma.store_wait(0)

    @gluon.jit
    def _consumer0(x_desc, w_desc, y_desc, pre_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, b_ptr, M, N, K,
                   ACT: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_PRE: gl.constexpr, GROUP: gl.constexpr):
        _consumer(x_desc, w_desc, y_desc, pre_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, b_ptr, M, N, K,
                  ACT, HAS_BIAS, STORE_PRE, GROUP, 0)

    @gluon.jit
    def _consumer1(x_desc, w_desc, y_desc, pre_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, b_ptr, M, N, K,
                   ACT: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_PRE: gl.constexpr, GROUP: gl.constexpr):
        _consumer(x_desc, w_desc, y_desc, pre_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, b_ptr, M, N, K,
                  ACT, HAS_BIAS, STORE_PRE, GROUP, 1)

    @gluon.jit
    def _linear_act_pingpong_kernel(x_desc, w_desc, y_desc, pre_desc, b_ptr, M, N, K,
                                    ACT: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_PRE: gl.constexpr,
                                    GROUP: gl.constexpr, NSTAGE: gl.constexpr,
                                    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        dtype: gl.constexpr = x_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [NSTAGE] + x_desc.block_type.shape, x_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [NSTAGE] + w_desc.block_type.shape, w_desc.layout)
        c_bufs = gl.allocate_shared_memory(dtype, [2] + y_desc.block_type.shape, y_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NSTAGE):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        args = (x_desc, w_desc, y_desc, pre_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, b_ptr, M, N, K,
                ACT, HAS_BIAS, STORE_PRE, GROUP)
        gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_producer, args)], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])

    @functools.lru_cache(None)
    def _smem_layout(dtype, rows, cols):
        return gl.NVMMASharedLayout.get_default_for([rows, cols], _GL_DTYPES[dtype])


def linear_act_fwd_pingpong(x, weight, bias, act_id, y, pre, programs, block_k=BLOCK_K, stages=STAGES,
                            group=GROUP_M):
    """y = act(x W^T + b) into y (and x W^T + b into pre when pre is not None); x (M, K), weight
    (N, K), y/pre (M, N), 16-bit, one dtype, TMA-ready (linear_act._tma_ok); M, N, K > 0.
    programs: SMs to use (one program each). block_k / stages / group: the K step, the operand
    ring's depth and the tile walk's band height; the library runs the defaults (parameters for
    tuning runs)."""
    M, K = x.shape
    N = weight.shape[0]

    def desc(t, rows, cols):
        return TensorDescriptor.from_tensor(t, [rows, cols], _smem_layout(t.dtype, rows, cols))

    y_desc = desc(y, BLOCK_M, BLOCK_N)
    grid = (min(programs, cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)),)
    launch(
        _linear_act_pingpong_kernel, grid, desc(x, BLOCK_M, block_k), desc(weight, BLOCK_N, block_k), y_desc,
        desc(pre, BLOCK_M, BLOCK_N) if pre is not None else y_desc, bias if bias is not None else x, M, N, K,
        ACT=act_id, HAS_BIAS=bias is not None, STORE_PRE=pre is not None, GROUP=group, NSTAGE=stages,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG)
