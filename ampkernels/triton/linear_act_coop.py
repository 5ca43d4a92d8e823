"""Hopper linear_act forward: a cooperative 256 x 128 main loop beside an epilogue warpgroup (Gluon).

Why: the ping-pong kernel (linear_act_pingpong.py) hides the activation behind the other
consumer's main loop, but each consumer runs a 128 x 128 tile with its own x and W tiles.
cuBLAS's fastest plain matmuls at the benchmark shapes run 256 x 128 tiles (nvjet
..._256x128_..._coopA in benchmarks/results/h200-2026-11-30-profile-mlp-block.txt), which read a
W tile once for 256 rows: a quarter fewer operand bytes from L2 per FLOP. Here one program per
SM holds four partitions:

    mma 0, 1  (4 warps each)  rows 0-127 / 128-255 of the same 256 x 128 tile: wgmma main loop
                              over a shared W tile, bias in fp32, rounding to y's dtype; the
                              rounded pre-activation goes to its half of a shared-memory buffer
    epilogue  (4 warps)       per half: stores pre (when asked), applies the activation in
                              place, stores y, hands the half back
    producer  (1 warp)        TMA loads of two 128-row x tiles and one W tile per K step into a
                              STAGES-deep ring

so the activation runs beside the next tile's main loop, as in ping-pong, while the tensor cores
see the larger tile. Same contract as the other forward kernels (epilogue.py's formulas and tile
order, pre rounded before the activation). An experiment: nothing dispatches to it yet;
scripts/pingpong_probe.py times it and tests/test_linear_act.py checks it on the GPU. Gluon has
no interpreter; scripts/triton_compile_check.py compiles it for sm_90.
"""
import triton

from . import linear_act_pingpong as _pingpong
from .epilogue import _act_fwd, _tile_origin  # triton.jit functions: Gluon functions call them
from .linear_act_pingpong import available, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .linear_act_pingpong import _mma_k_loop

HALF_M, BLOCK_N, BLOCK_K = 128, 128, 64  # a tile is 2 x HALF_M rows
STAGES = 3  # 3 x 48 KB of operand ring + 2 x 32 KB of pre/y staging: 208 KB of the 227 KB
GROUP_M = 8
# registers a thread: 128 at launch (13 warps round up to 16: 16 x 32 x 128 = 64 K); after
# setmaxnreg mma 1 takes 200, the epilogue 88, the producer's warpgroup 24, and mma 0 (the
# default partition) what is left (200)
MAXNREG, MMA_REGS, EPILOGUE_REGS, PRODUCER_REGS = 128, 200, 88, 24

__all__ = ["available", "linear_act_fwd_coop"]

if gluon is not None:
    @gluon.jit
    def _producer(x_desc, w_desc, y_desc, pre_desc, a0_bufs, a1_bufs, b_bufs, p_bufs, ready, empty, p_ready, p_empty,
                  b_ptr, M, N, K, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_PRE: gl.constexpr,
                  GROUP: gl.constexpr):
        HM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        NSTAGE: gl.constexpr = a0_bufs.type.shape[0]
        num_m = gl.cdiv(M, 2 * HM)
        num_n = gl.cdiv(N, BN)
        k_tiles = gl.cdiv(K, BK)
        count = 0  # ring slots filled so far, over all of this program's tiles
        for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            off_m, off_n = _tile_origin(tile, num_m, num_n, GROUP, 2 * HM, BN)
            for kk in range(k_tiles):
                slot = count % NSTAGE
                mbarrier.wait(empty.index(slot), ((count // NSTAGE) & 1) ^ 1)  # the first pass finds it free
                mbarrier.expect(ready.index(slot), 2 * x_desc.block_type.nbytes + w_desc.block_type.nbytes)
                # rows past M and the K tail are zero-filled by TMA (a whole box past M too)
                tma.async_copy_global_to_shared(x_desc, [off_m, kk * BK], ready.index(slot), a0_bufs.index(slot))
                tma.async_copy_global_to_shared(x_desc, [off_m + HM, kk * BK], ready.index(slot),
                                                a1_bufs.index(slot))
                tma.async_copy_global_to_shared(w_desc, [off_n, kk * BK], ready.index(slot), b_bufs.index(slot))
                count += 1

    @gluon.jit
    def _mma(x_desc, w_desc, y_desc, pre_desc, a0_bufs, a1_bufs, b_bufs, p_bufs, ready, empty, p_ready, p_empty,
             b_ptr, M, N, K, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_PRE: gl.constexpr,
             GROUP: gl.constexpr, HALF: gl.constexpr):
        HM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        NSTAGE: gl.constexpr = a0_bufs.type.shape[0]
        dtype: gl.constexpr = x_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 16])
        if HALF == 0:
            a_bufs = a0_bufs
        else:
            a_bufs = a1_bufs
        p_buf = p_bufs.index(HALF)
        num_m = gl.cdiv(M, 2 * HM)
        num_n = gl.cdiv(N, BN)
        k_tiles = gl.cdiv(K, BK)
        count = 0  # ring slots consumed (the producer's count: both halves consume every slot)
        for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            local = (tile - gl.program_id(0)) // gl.num_programs(0)  # this program's tiles before this one
            _, off_n = _tile_origin(tile, num_m, num_n, GROUP, 2 * HM, BN)
            acc = gl.zeros((HM, BN), dtype=gl.float32, layout=acc_layout)
            # this half's releases of the slots (a slot is free once both halves have released
            # it: empty counts 2 arrivals)
            acc, count = _mma_k_loop(a_bufs, b_bufs, ready, empty, acc, count, k_tiles)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((count + NSTAGE - 1) % NSTAGE), count=1)
            # the bias load is masked off without a bias rather than left out: Triton 3.6 fails
            # to lower a kernel whose partitions never use b_ptr (see linear_act_pingpong.py)
            offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
            acc = acc + gl.load(b_ptr + offs_n, mask=(offs_n < N) & HAS_BIAS, other=0.0).to(gl.float32)[None, :]
            pre = acc.to(dtype)  # rounded as the unfused path (GEMM, then act) rounds it
            mbarrier.wait(p_empty.index(HALF), (local & 1) ^ 1)  # the epilogue is done with the last tile's
            p_buf.store(pre)
            fence_async_shared()  # generic-proxy writes, then the epilogue's TMA store reads them
            mbarrier.arrive(p_ready.index(HALF), count=1)

    @gluon.jit
    def _mma0(x_desc, w_desc, y_desc, pre_desc, a0_bufs, a1_bufs, b_bufs, p_bufs, ready, empty, p_ready, p_empty,
              b_ptr, M, N, K, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_PRE: gl.constexpr,
              GROUP: gl.constexpr):
        _mma(x_desc, w_desc, y_desc, pre_desc, a0_bufs, a1_bufs, b_bufs, p_bufs, ready, empty, p_ready, p_empty,
             b_ptr, M, N, K, ACT, HAS_BIAS, STORE_PRE, GROUP, 0)

    @gluon.jit
    def _mma1(x_desc, w_desc, y_desc, pre_desc, a0_bufs, a1_bufs, b_bufs, p_bufs, ready, empty, p_ready, p_empty,
              b_ptr, M, N, K, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_PRE: gl.constexpr,
              GROUP: gl.constexpr):
        _mma(x_desc, w_desc, y_desc, pre_desc, a0_bufs, a1_bufs, b_bufs, p_bufs, ready, empty, p_ready, p_empty,
             b_ptr, M, N, K, ACT, HAS_BIAS, STORE_PRE, GROUP, 1)

    @gluon.jit
    def _epilogue(x_desc, w_desc, y_desc, pre_desc, a0_bufs, a1_bufs, b_bufs, p_bufs, ready, empty, p_ready,
                  p_empty, b_ptr, M, N, K, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_PRE: gl.constexpr,
                  GROUP: gl.constexpr):
        HM: gl.constexpr = x_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        dtype: gl.constexpr = x_desc.dtype
        ROWS: gl.constexpr = 16  # rows of a half held at once: 16 elements a thread
        # 8 contiguous elements (16 bytes) a thread, a warp across whole rows
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BN // 8), BN // 8], [4, 1], [1, 0])
        num_m = gl.cdiv(M, 2 * HM)
        num_n = gl.cdiv(N, BN)
        for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            local = (tile - gl.program_id(0)) // gl.num_programs(0)
            off_m, off_n = _tile_origin(tile, num_m, num_n, GROUP, 2 * HM, BN)
            for h in gl.static_range(2):
                p_buf = p_bufs.index(h)
                mbarrier.wait(p_ready.index(h), local & 1)
                if STORE_PRE:
                    tma.async_copy_shared_to_global(pre_desc, [off_m + h * HM, off_n], p_buf)  # rows past M clipped
                    tma.store_wait(0)  # read out before the activation overwrites it
                for r in gl.static_range(HM // ROWS):
                    rows = p_buf.slice(r * ROWS, ROWS, dim=0)
                    rows.store(_act_fwd(rows.load(layout).to(gl.float32), ACT).to(dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(y_desc, [off_m + h * HM, off_n], p_buf)
                tma.store_wait(0)  # read out before the half is handed back
                mbarrier.arrive(p_empty.index(h), count=1)

    @gluon.jit
    def _linear_act_coop_kernel(x_desc, w_desc, y_desc, pre_desc, b_ptr, M, N, K,
                                ACT: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_PRE: gl.constexpr,
                                GROUP: gl.constexpr, NSTAGE: gl.constexpr, MMA_REGS: gl.constexpr,
                                EPILOGUE_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        dtype: gl.constexpr = x_desc.dtype
        a0_bufs = gl.allocate_shared_memory(dtype, [NSTAGE] + x_desc.block_type.shape, x_desc.layout)
        a1_bufs = gl.allocate_shared_memory(dtype, [NSTAGE] + x_desc.block_type.shape, x_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [NSTAGE] + w_desc.block_type.shape, w_desc.layout)
        p_bufs = gl.allocate_shared_memory(dtype, [2] + y_desc.block_type.shape, y_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NSTAGE):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both halves release a slot
        for i in gl.static_range(2):
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_empty.index(i), count=1)
        args = (x_desc, w_desc, y_desc, pre_desc, a0_bufs, a1_bufs, b_bufs, p_bufs, ready, empty, p_ready, p_empty,
                b_ptr, M, N, K, ACT, HAS_BIAS, STORE_PRE, GROUP)
        gl.warp_specialize([(_mma0, args), (_mma1, args), (_epilogue, args), (_producer, args)], [4, 4, 1],
                           [MMA_REGS, EPILOGUE_REGS, PRODUCER_REGS])


def linear_act_fwd_coop(x, weight, bias, act_id, y, pre, programs, block_k=BLOCK_K, stages=STAGES, group=GROUP_M):
    """y = act(x W^T + b) into y (and x W^T + b into pre when pre is not None); x (M, K), weight
    (N, K), y/pre (M, N), 16-bit, one dtype, TMA-ready (linear_act._tma_ok); M, N, K > 0.
    programs: SMs to use (one program each). block_k / stages / group as for the ping-pong kernel
    (scripts/pingpong_probe.py times other choices; 64 x 3 and 32 x 6 fill the shared memory)."""
    M, K = x.shape
    N = weight.shape[0]

    def desc(t, rows, cols):
        return TensorDescriptor.from_tensor(t, [rows, cols], _pingpong._smem_layout(t.dtype, rows, cols))

    y_desc = desc(y, HALF_M, BLOCK_N)
    grid = (min(programs, triton.cdiv(M, 2 * HALF_M) * triton.cdiv(N, BLOCK_N)),)
    _linear_act_coop_kernel[grid](
        desc(x, HALF_M, block_k), desc(weight, BLOCK_N, block_k), y_desc,
        desc(pre, HALF_M, BLOCK_N) if pre is not None else y_desc, bias if bias is not None else x, M, N, K,
        ACT=act_id, HAS_BIAS=bias is not None, STORE_PRE=pre is not None, GROUP=group, NSTAGE=stages,
        MMA_REGS=MMA_REGS, EPILOGUE_REGS=EPILOGUE_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG)
