// LayerNorm and RMSNorm over the last dim of a contiguous (rows, cols) matrix, forward and
// backward, all math in fp32. One kernel serves both norms (is_rms: no mean, no bias).
//
// Dtypes: x (template T) is fp32/fp16/bf16; in the backward dy has x's dtype too (the binding
// upcasts the 16-bit one of the two when they differ, exactly). Every other tensor carries its
// own runtime dtype (residual, residual_out, weight/bias, out, dx, dresidual): a uniform switch per tile picks
// the storage type, so any mix (fp16 x with fp32 params, fp32 out, fp32 residual) runs without
// a build per combination. mean and rstd are fp32, one per row.
//
// Forward, norm_fwd_kernel: a group of G threads (1..512, a power of two) owns one row; thread t
// holds the row's vectors t, t+G, ... (kIters = 1..4 vectors of kVec elements: 16-byte loads when
// cols and pointers allow, else 1 element), so x and residual are read once, all loads issued
// before the first reduction. Without a residual the row is kept in registers in x's own 16-bit
// storage type and converted to fp32 at each use. mean is a group sum, then variance a second
// sum of centred squares (robust for rows with a large mean). Rows longer than 512 threads x 4
// vectors take norm_fwd_looped_kernel: one block per row, three passes over the row (L2-resident).
// With a residual, s = x + residual is normalised unrounded and stored as residual_out.
// Why this shape: the kernel lives on bytes in flight per thread and on blocks resident per SM
// (one block's reductions overlap another's loads); fewer vectors a thread, two rows a group, an
// fp32 tile of the 16-bit row and a pipelined persistent forward were all slower (numbers in
// docs/performance.md). The common 16-bit case has G as a compile-time constant
// (fwd_static_group): fewer integer instructions and registers, 16-byte output stores.
//
// Backward. Three kernels, picked per call (bwd_pipe_config, bwd_config); all persistent: each
// block loops over rows, writes dx (and dresidual when its dtype differs from dx's) and keeps its
// dweight = sum(dy * xhat) and dbias = sum(dy) column sums in fp32 without atomics, then writes
// one fp32 partial row; norm_reduce_partials_kernel adds the blocks' partial rows in a fixed
// order. The grid depends only on the shape, the dtypes and the GPU, so the grads are bitwise
// repeatable.
// - norm_bwd_pipe_kernel (16-bit x/dy, cols % 8 == 0, 16-byte aligned, dx in x's dtype, no
//   separate dresidual, dresidual_out absent or in x's dtype; params fp32, 16-bit or none;
//   cols <= 16384 where its buffers fit the GPU's shared memory: on the H200 all but N > 14336
//   with dresidual_out): a group of G <= 512 threads per row, each thread owning the same 2..4
//   chunks of 8 columns in every row. Its weight stays in fp32 registers (for 4 chunks in a
//   per-thread shared-memory slot) and its dweight/dbias sums in registers for the whole
//   kernel; the next rows' x/dy (and dresidual_out) chunks are in flight as cp.async copies into
//   a 2-stage buffer, each thread copying and reading back only its own slots (no barrier guards
//   the buffer); mean/rstd are loaded one row ahead; a row takes one barrier (its two sums, when
//   G > 32). Why: a backward that loads each row only when it gets there exposes its load
//   latency at one block per SM. Its 2 stages and block sizes are reasoned, not tuned
//   (kPipeStages = 3 is a one-line change where shared memory allows).
// - norm_bwd_kernel (the rest up to 1024 threads x 2 vectors per row): as the forward's tile,
//   loads issued when the row starts, per-thread shared-memory slots for the column sums. Its
//   16-bit 2-vector variant spills ~80 bytes (only for cases the pipelined kernel does not take).
// - norm_bwd_looped_kernel (longer rows): two passes per row, partial sums kept in the block's
//   own partial row in global memory.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>

#include "activations.cuh"
#include "host_cache.cuh"

namespace ampk {
namespace {

constexpr int kFwdMaxGroup = 512;   // threads per row, register-tile forward
constexpr int kFwdMaxIters = 4;     // vectors per thread, register-tile forward (128 registers)
constexpr int kBwdMaxGroup = 1024;  // threads per row, register-tile backward
constexpr int kBwdMaxIters = 2;     // vectors per thread, register-tile backward (dx, dy, xhat, w live)
constexpr int kLoopedThreads = 512;

// kVec elements of one storage type, loaded and stored as one (or two 16-byte) transactions.
template <typename TS, int kVec>
struct alignas(sizeof(TS) * kVec < 16 ? sizeof(TS) * kVec : 16) Pack {
  TS e[kVec];
};

template <typename TS, int kVec>
__device__ __forceinline__ void load_pack(const void* p, int64_t i, float (&v)[kVec]) {
  const Pack<TS, kVec> pk = *reinterpret_cast<const Pack<TS, kVec>*>(static_cast<const TS*>(p) + i);
#pragma unroll
  for (int e = 0; e < kVec; ++e) v[e] = to_f32(pk.e[e]);
}

template <typename TS, int kVec>
__device__ __forceinline__ void store_pack(void* p, int64_t i, const float (&v)[kVec]) {
  Pack<TS, kVec> pk;
#pragma unroll
  for (int e = 0; e < kVec; ++e) pk.e[e] = from_f32<TS>(v[e]);
  *reinterpret_cast<Pack<TS, kVec>*>(static_cast<TS*>(p) + i) = pk;
}

// Element e of a pack in fp32. bf16 is read from the pack's 32-bit words (bf16 is the top half
// of an fp32: a shift or a mask), so a raw bf16 tile stays in packed 32-bit registers.
template <typename TS, int kVec>
__device__ __forceinline__ float elem_f32(const Pack<TS, kVec>& p, int e) {
  if constexpr (std::is_same_v<TS, __nv_bfloat16> && kVec % 2 == 0) {
    uint32_t u;
    memcpy(&u, &p.e[e & ~1], 4);
    return __uint_as_float(e % 2 == 0 ? u << 16 : u & 0xffff0000u);
  } else {
    return to_f32(p.e[e]);
  }
}

// One vector of a tensor whose dtype is known only at run time (a uniform branch).
template <int kVec>
__device__ __forceinline__ void load_vec(const void* p, DType t, int64_t i, float (&v)[kVec]) {
  switch (t) {
    case DType::kFloat32: load_pack<float, kVec>(p, i, v); break;
    case DType::kFloat16: load_pack<__half, kVec>(p, i, v); break;
    case DType::kBFloat16: load_pack<__nv_bfloat16, kVec>(p, i, v); break;
  }
}

template <int kVec>
__device__ __forceinline__ void store_vec(void* p, DType t, int64_t i, const float (&v)[kVec]) {
  switch (t) {
    case DType::kFloat32: store_pack<float, kVec>(p, i, v); break;
    case DType::kFloat16: store_pack<__half, kVec>(p, i, v); break;
    case DType::kBFloat16: store_pack<__nv_bfloat16, kVec>(p, i, v); break;
  }
}

// A row's tile: slot k of thread t is vector t + k*G of the row. Loads are all issued before any
// value is used, so one thread keeps kIters transactions in flight.
template <typename TS, int kVec, int kIters>
__device__ __forceinline__ void load_tile_raw(Pack<TS, kVec> (&raw)[kIters], const void* p, int64_t base, int t,
                                              int G, int64_t nvec, bool valid) {
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int64_t j = t + int64_t(k) * G;
    if constexpr (sizeof(Pack<TS, kVec>) == 16) {
      // as one 128-bit word: the compiler otherwise selects load-or-zero per 16-bit element, a
      // byte permute each (docs/performance.md: 2-7% on the LayerNorm forward)
      uint4 u = make_uint4(0u, 0u, 0u, 0u);
      if (valid && j < nvec) u = *reinterpret_cast<const uint4*>(static_cast<const TS*>(p) + base + j * kVec);
      memcpy(&raw[k], &u, 16);
    } else if (valid && j < nvec) {
      raw[k] = *reinterpret_cast<const Pack<TS, kVec>*>(static_cast<const TS*>(p) + base + j * kVec);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) raw[k].e[e] = from_f32<TS>(0.f);
    }
  }
}

template <typename TS, int kVec, int kIters>
__device__ __forceinline__ void convert_tile(const Pack<TS, kVec> (&raw)[kIters], float (&v)[kIters][kVec]) {
#pragma unroll
  for (int k = 0; k < kIters; ++k)
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[k][e] = elem_f32(raw[k], e);
}

// An empty asm that "rewrites" every register of a raw tile. Conversions of the tile to fp32 made
// before it cannot be reused after it, so the compiler recomputes them (a few ALU ops) instead of
// keeping an fp32 copy of the tile alive across the reductions (twice the registers of 16-bit x).
template <typename TS, int kVec, int kIters>
__device__ __forceinline__ void refresh_tile(Pack<TS, kVec> (&p)[kIters]) {
  if constexpr (sizeof(TS) * kVec % 4 == 0) {  // fp32, or 16-bit vectors
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      uint32_t u[sizeof(TS) * kVec / 4];
      memcpy(u, &p[k], sizeof(u));
#pragma unroll
      for (int i = 0; i < int(sizeof(u) / 4); ++i) asm volatile("" : "+r"(u[i]));
      memcpy(&p[k], u, sizeof(u));
    }
  } else {
    static_assert(sizeof(TS) == 2 && kVec == 1);
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      unsigned short u;
      memcpy(&u, &p[k], 2);
      asm volatile("" : "+h"(u));
      memcpy(&p[k], &u, 2);
    }
  }
}

template <int kVec, int kIters>
__device__ __forceinline__ void load_tile(float (&v)[kIters][kVec], const void* p, DType t, int64_t base, int tid,
                                          int G, int64_t nvec, bool valid) {
  auto go = [&]<typename TS>() {
    Pack<TS, kVec> raw[kIters];
    load_tile_raw<TS, kVec, kIters>(raw, p, base, tid, G, nvec, valid);
    convert_tile<TS, kVec, kIters>(raw, v);
  };
  switch (t) {
    case DType::kFloat32: go.template operator()<float>(); break;
    case DType::kFloat16: go.template operator()<__half>(); break;
    case DType::kBFloat16: go.template operator()<__nv_bfloat16>(); break;
  }
}

template <int kVec, int kIters>
__device__ __forceinline__ void store_tile(const float (&v)[kIters][kVec], void* p, DType t, int64_t base, int tid,
                                           int G, int64_t nvec, bool valid) {
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int64_t j = tid + int64_t(k) * G;
    if (valid && j < nvec) store_vec<kVec>(p, t, base + j * kVec, v[k]);
  }
}

// Sums over the G threads of a row group (G a power of two; groups are aligned in the block), kN
// values at once (one exchange through shared memory for all of them). Every thread of the block
// must call it (it may synchronise the block). All lanes get the same bits: a butterfly adds each
// pair in both orders (float addition commutes), and the warps' partials are added in warp order.
// `reused`: red may still be read by an earlier call on the same buffer, so wait for those
// readers first; a buffer used once per block needs no such wait.
template <int kN>
__device__ __forceinline__ void group_sum(float (&v)[kN], int G, float (&red)[kN][32], bool reused) {
  for (int off = (G < 32 ? G : 32) / 2; off > 0; off >>= 1) {
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], off);
  }
  if (G <= 32) return;
  const int warp = threadIdx.x / 32;
  if (reused) __syncthreads();
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int i = 0; i < kN; ++i) red[i][warp] = v[i];
  }
  __syncthreads();
  const int first = (threadIdx.x / G) * (G / 32);
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    float total = 0.f;
    for (int w = 0; w < G / 32; ++w) total += red[i][first + w];
    v[i] = total;
  }
}

// Sum over the whole block (looped kernels); every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float (&red)[1][32]) {
  float s[1] = {v};
  group_sum<1>(s, blockDim.x, red, true);
  return s[0];
}

// Sum of (x - center)^2 over the row elements thread t holds (register-tile layout: vectors t,
// t + G, ...; slots past the row's nvec vectors skipped).
template <typename TK, int kVec, int kIters>
__device__ __forceinline__ float centred_squares(const Pack<TK, kVec> (&v)[kIters], float center, int t, int G,
                                                 int64_t nvec) {
  float sq = 0.f;
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    if (t + int64_t(k) * G < nvec) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float d = elem_f32(v[k], e) - center;
        sq += d * d;
      }
    }
  }
  return sq;
}

// ------------------------------------------------------------------ forward

// One row per group of G threads (G a power of two, 1..512; the block holds blockDim.x / G rows).
// Thread t holds the row's vectors t, t + G, ..., t + (kIters - 1) * G; all its loads of x (and
// residual) are issued before the first reduction. Between the passes the row stays in registers
// in x's own storage type (16-bit x: half the registers of fp32, so two 512-thread blocks fit per
// SM and one block's reductions overlap another's loads), or in fp32 with a residual (kResidual:
// the unrounded sum x + residual is what gets normalised). The params are read per vector after
// the reductions (every row reads them: L1/L2 hits), their storage type fixed per dispatch (no
// dtype branch per vector); each output vector is written as soon as it is computed.
// kGroup: G as a compile-time constant (0: the `group` argument); kMinBlocks: the blocks an SM
// the launcher wants resident (the register budget), see norm_forward and fwd_static_group.
template <typename T, bool kResidual, int kVec, int kIters, int kGroup, int kMinBlocks>
__global__ void __launch_bounds__(kFwdMaxGroup, kMinBlocks)
    norm_fwd_kernel(const NormForwardArgs a, const int group) {
  using TK = std::conditional_t<kResidual, float, T>;
  const int G = kGroup != 0 ? kGroup : group;
  __shared__ float red_mean[1][32], red_var[1][32];
  const int t = threadIdx.x % G;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / G) + threadIdx.x / G;
  const bool valid = row < a.rows;
  const int64_t nvec = a.cols / kVec, base = row * a.cols;

  Pack<TK, kVec> v[kIters];  // slots outside the row, and invalid rows, hold 0
  if constexpr (kResidual) {
    Pack<T, kVec> raw[kIters];
    load_tile_raw<T, kVec, kIters>(raw, a.x, base, t, G, nvec, valid);
    float r[kIters][kVec];
    load_tile<kVec, kIters>(r, a.residual, a.residual_dtype, base, t, G, nvec, valid);
#pragma unroll
    for (int k = 0; k < kIters; ++k)
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[k].e[e] = elem_f32(raw[k], e) + r[k][e];
    if (a.residual_out != nullptr) {
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const int64_t j = t + int64_t(k) * G;
        if (valid && j < nvec) store_vec<kVec>(a.residual_out, a.residual_out_dtype, base + j * kVec, v[k].e);
      }
    }
  } else {
    load_tile_raw<T, kVec, kIters>(v, a.x, base, t, G, nvec, valid);
  }

  float mean = 0.f;
  if (!a.is_rms) {
    float s[1] = {0.f};
#pragma unroll
    for (int k = 0; k < kIters; ++k)
#pragma unroll
      for (int e = 0; e < kVec; ++e) s[0] += elem_f32(v[k], e);
    group_sum<1>(s, G, red_mean, false);
    mean = s[0] / float(a.cols);
  }
  if constexpr (!kResidual && sizeof(T) == 2) refresh_tile<T, kVec, kIters>(v);
  float sq[1] = {centred_squares(v, mean, t, G, nvec)};
  group_sum<1>(sq, G, red_var, false);
  const float rstd = rsqrtf(sq[0] / float(a.cols) + a.eps);
  if constexpr (!kResidual && sizeof(T) == 2) refresh_tile<T, kVec, kIters>(v);
  if (valid && t == 0) {
    if (a.mean != nullptr) a.mean[row] = mean;
    if (a.rstd != nullptr) a.rstd[row] = rstd;
  }

  auto normalise = [&]<typename TP>() {
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      const int64_t j = t + int64_t(k) * G;
      if (!(valid && j < nvec)) continue;
      float w[kVec], b[kVec], y[kVec];
      if (a.weight != nullptr) {
        load_pack<TP, kVec>(a.weight, j * kVec, w);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) w[e] = 1.f;
      }
      if (a.bias != nullptr) {
        load_pack<TP, kVec>(a.bias, j * kVec, b);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) b[e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) y[e] = (elem_f32(v[k], e) - mean) * rstd * w[e] + b[e];
      store_vec<kVec>(a.out, a.out_dtype, base + j * kVec, y);
    }
  };
  switch (a.param_dtype) {
    case DType::kFloat32: normalise.template operator()<float>(); break;
    case DType::kFloat16: normalise.template operator()<__half>(); break;
    case DType::kBFloat16: normalise.template operator()<__nv_bfloat16>(); break;
  }
}

// One block per row, any length: pass 1 sums, pass 2 centred squares, pass 3 writes.
template <typename T, int kVec>
__global__ void __launch_bounds__(kLoopedThreads) norm_fwd_looped_kernel(const NormForwardArgs a) {
  __shared__ float red[1][32];
  const int64_t row = blockIdx.x, nvec = a.cols / kVec, base = row * a.cols;
  auto load_s = [&](int64_t j, float (&v)[kVec]) {
    load_pack<T, kVec>(a.x, base + j * kVec, v);
    if (a.residual != nullptr) {
      float r[kVec];
      load_vec<kVec>(a.residual, a.residual_dtype, base + j * kVec, r);
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] += r[e];
    }
  };
  float mean = 0.f;
  if (!a.is_rms) {
    float s = 0.f;
    for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
      float v[kVec];
      load_s(j, v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) s += v[e];
    }
    mean = block_sum(s, red) / float(a.cols);
  }
  float sq = 0.f;
  for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
    float v[kVec];
    load_s(j, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) sq += (v[e] - mean) * (v[e] - mean);
  }
  const float rstd = rsqrtf(block_sum(sq, red) / float(a.cols) + a.eps);
  if (threadIdx.x == 0) {
    if (a.mean != nullptr) a.mean[row] = mean;
    if (a.rstd != nullptr) a.rstd[row] = rstd;
  }
  for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
    float v[kVec], y[kVec];
    load_s(j, v);
    if (a.residual_out != nullptr) store_vec<kVec>(a.residual_out, a.residual_out_dtype, base + j * kVec, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) y[e] = (v[e] - mean) * rstd;
    if (a.weight != nullptr) {
      float w[kVec];
      load_vec<kVec>(a.weight, a.param_dtype, j * kVec, w);
#pragma unroll
      for (int e = 0; e < kVec; ++e) y[e] *= w[e];
    }
    if (a.bias != nullptr) {
      float b[kVec];
      load_vec<kVec>(a.bias, a.param_dtype, j * kVec, b);
#pragma unroll
      for (int e = 0; e < kVec; ++e) y[e] += b[e];
    }
    store_vec<kVec>(a.out, a.out_dtype, base + j * kVec, y);
  }
}

// ------------------------------------------------------------------ backward

template <typename T, int kVec, int kIters>
__global__ void __launch_bounds__(kBwdMaxGroup) norm_bwd_kernel(const NormBackwardArgs a, const int G) {
  // acc[threadIdx.x * kStride + s]: this thread's running dweight (s < E) and dbias (s >= E) sums
  // for its slot s. Offsets are compile-time constants (no address registers); the odd stride
  // puts a warp's 32 threads on 32 banks.
  extern __shared__ float acc_all[];
  __shared__ float red[2][32];
  constexpr int E = kIters * kVec, kStride = 2 * E + 1;
  float* const acc = acc_all + threadIdx.x * kStride;
  const int t = threadIdx.x % G, groups = blockDim.x / G, g = threadIdx.x / G;
  const int64_t nvec = a.cols / kVec;
  const bool want_dw = a.dweight_partial != nullptr, want_db = a.dbias_partial != nullptr;
#pragma unroll
  for (int s = 0; s < 2 * E; ++s) acc[s] = 0.f;

  const float inv_n = 1.f / float(a.cols);

  // Every group of the block runs the same number of iterations (group_sum may synchronise).
  // Register budget (1024 threads: 64 per thread): the x, dy and w tiles, then only xh and g.
  for (int64_t row0 = int64_t(blockIdx.x) * groups; row0 < a.rows; row0 += int64_t(gridDim.x) * groups) {
    const int64_t row = row0 + g;
    const bool valid = row < a.rows;
    const int64_t base = row * a.cols;
    float xh[kIters][kVec], gr[kIters][kVec];
    {
      Pack<T, kVec> raw_x[kIters];
      load_tile_raw<T, kVec, kIters>(raw_x, a.x, base, t, G, nvec, valid);
      convert_tile<T, kVec, kIters>(raw_x, xh);
    }
    load_tile<kVec, kIters>(gr, a.dy, a.dy_dtype, base, t, G, nvec, valid);  // dy may be fp32 beside 16-bit x
    const float mean = (valid && a.mean != nullptr) ? a.mean[row] : 0.f;
    const float rstd = valid ? a.rstd[row] : 0.f;
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      const bool in = t + int64_t(k) * G < nvec;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        xh[k][e] = in ? (xh[k][e] - mean) * rstd : 0.f;
        // dy and xh are 0 outside the row and for invalid rows: the sums need no predicate
        const int s = k * kVec + e;
        if (want_dw) acc[s] += gr[k][e] * xh[k][e];
        if (want_db) acc[E + s] += gr[k][e];
      }
    }
    if (a.weight != nullptr) {  // gr = dy * w; w is re-read per row (an L1 hit) to save registers
      float w[kIters][kVec];
      load_tile<kVec, kIters>(w, a.weight, a.param_dtype, 0, t, G, nvec, true);
#pragma unroll
      for (int k = 0; k < kIters; ++k)
#pragma unroll
        for (int e = 0; e < kVec; ++e) gr[k][e] *= w[k][e];
    }
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int k = 0; k < kIters; ++k)
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        s1 += gr[k][e] * xh[k][e];
        s2 += gr[k][e];
      }
    float s[2] = {s1, s2};
    group_sum<2>(s, G, red, true);  // both sums in one exchange (RMSNorm ignores the second)
    const float c1 = s[0] * inv_n;
    const float c2 = a.is_rms ? 0.f : s[1] * inv_n;
#pragma unroll
    for (int k = 0; k < kIters; ++k)
#pragma unroll
      for (int e = 0; e < kVec; ++e) gr[k][e] = rstd * (gr[k][e] - xh[k][e] * c1 - c2);  // gr is now dx
    if (a.dresidual_out != nullptr) {
      load_tile<kVec, kIters>(xh, a.dresidual_out, a.dresidual_out_dtype, base, t, G, nvec, valid);
#pragma unroll
      for (int k = 0; k < kIters; ++k)
#pragma unroll
        for (int e = 0; e < kVec; ++e) gr[k][e] += xh[k][e];
    }
    store_tile<kVec, kIters>(gr, a.dx, a.dx_dtype, base, t, G, nvec, valid);
    if (a.dresidual != nullptr) store_tile<kVec, kIters>(gr, a.dresidual, a.dresidual_dtype, base, t, G, nvec, valid);
  }
  if (!want_dw && !want_db) return;
  __syncthreads();
  if (g != 0) return;
  // group 0 adds the block's row groups in a fixed order and writes the block's partial row
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int64_t j = t + int64_t(k) * G;
    if (j >= nvec) continue;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int s = k * kVec + e;
      const int64_t col = j * kVec + e;
      float dw = 0.f, db = 0.f;
      for (int q = 0; q < groups; ++q) {
        dw += acc_all[(q * G + t) * kStride + s];
        db += acc_all[(q * G + t) * kStride + E + s];
      }
      if (want_dw) a.dweight_partial[int64_t(blockIdx.x) * a.cols + col] = dw;
      if (want_db) a.dbias_partial[int64_t(blockIdx.x) * a.cols + col] = db;
    }
  }
}

// Persistent blocks, one row at a time, any length: pass 1 the two row sums, pass 2 dx and the
// block's partial sums, kept in its own partial row (each column always by the same thread).
template <typename T, int kVec>
__global__ void __launch_bounds__(kLoopedThreads) norm_bwd_looped_kernel(const NormBackwardArgs a) {
  __shared__ float red[1][32];
  const int64_t nvec = a.cols / kVec;
  float* dwp = a.dweight_partial == nullptr ? nullptr : a.dweight_partial + int64_t(blockIdx.x) * a.cols;
  float* dbp = a.dbias_partial == nullptr ? nullptr : a.dbias_partial + int64_t(blockIdx.x) * a.cols;
  for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      if (dwp != nullptr) dwp[j * kVec + e] = 0.f;
      if (dbp != nullptr) dbp[j * kVec + e] = 0.f;
    }
  }
  const float inv_n = 1.f / float(a.cols);
  auto load_all = [&](int64_t base, int64_t j, float mean, float rstd, float (&xh)[kVec], float (&dy)[kVec],
                      float (&w)[kVec]) {
    load_pack<T, kVec>(a.x, base + j * kVec, xh);
    load_vec<kVec>(a.dy, a.dy_dtype, base + j * kVec, dy);
    if (a.weight != nullptr) {
      load_vec<kVec>(a.weight, a.param_dtype, j * kVec, w);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) w[e] = 1.f;
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) xh[e] = (xh[e] - mean) * rstd;
  };
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t base = row * a.cols;
    const float mean = a.mean != nullptr ? a.mean[row] : 0.f;
    const float rstd = a.rstd[row];
    float s1 = 0.f, s2 = 0.f;
    for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
      float xh[kVec], dy[kVec], w[kVec];
      load_all(base, j, mean, rstd, xh, dy, w);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        s1 += dy[e] * w[e] * xh[e];
        s2 += dy[e] * w[e];
      }
    }
    const float c1 = block_sum(s1, red) * inv_n;
    const float c2 = a.is_rms ? 0.f : block_sum(s2, red) * inv_n;
    for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
      float xh[kVec], dy[kVec], w[kVec], d[kVec];
      load_all(base, j, mean, rstd, xh, dy, w);
      if (a.dresidual_out != nullptr) {
        load_vec<kVec>(a.dresidual_out, a.dresidual_out_dtype, base + j * kVec, d);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) d[e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) d[e] += rstd * (dy[e] * w[e] - xh[e] * c1 - c2);
      store_vec<kVec>(a.dx, a.dx_dtype, base + j * kVec, d);
      if (a.dresidual != nullptr) store_vec<kVec>(a.dresidual, a.dresidual_dtype, base + j * kVec, d);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        if (dwp != nullptr) dwp[j * kVec + e] += dy[e] * xh[e];
        if (dbp != nullptr) dbp[j * kVec + e] += dy[e];
      }
    }
  }
}

// ------------------------------------------------------------------ backward, pipelined (16-bit x and dy)

// norm_bwd_pipe_kernel: the backward for 16-bit x/dy in 16-byte chunks (the common AMP case).
// A group of G threads owns one row (G a power of two up to 32, else a multiple of 32, <= 512);
// thread t owns the chunks j = t + k*G (k < kIters) of every row it sees, i.e. the same columns
// for the whole kernel. Per thread, for those columns:
// - weight in fp32 registers, loaded once (kIters = 4: in a shared-memory slot of the thread
//   instead: 3 x 32 fp32 registers for w, dw and db leave too few for the rest at 512 threads);
// - dweight/dbias partial sums in fp32 registers, added over the block's rows in row order;
// - the next rows' x, dy (and dresidual_out) chunks in flight: cp.async into this thread's own
//   slots of a 2-stage shared buffer, issued as soon as the stage is free. A thread only ever
//   reads the slots it filled, so cp.async.wait_group alone orders the copies before the reads,
//   and the thread's own reads of a stage (whose values feed its dx stores, issued earlier in
//   program order) end before it refills that stage: no barrier guards the buffers.
// Per row: pass 1 reads x, dy from shared memory and adds dy*w*xhat and dy*w (and the dw/db
// sums); one group sum (shuffles, plus one shared-memory exchange and one barrier when G > 32;
// the exchange buffer alternates per row so one barrier suffices); pass 2 re-reads x, dy (cheap)
// and writes dx. At the end the block's row groups are added in group order (through the then
// idle staging buffer) into one fp32 partial row, as the other backward kernels do.
constexpr int kPipeVec = 8;             // 16-bit elements per 16-byte chunk
constexpr int kPipeMaxThreads = 512;    // threads per block, and per row at most
constexpr int kPipeBlockThreads = 256;  // block size when a row needs fewer threads
constexpr int kPipeStages = 2;
constexpr size_t kPipeStaticSmem = 2 * (kPipeMaxThreads / 32) * sizeof(float2);  // the row-sum buffers

// 16-byte copy global -> shared without registers (sm_80+). Elsewhere a plain copy: still correct
// because each thread reads back only what it copied itself.
__device__ __forceinline__ void cp_async16(void* dst_smem, const void* src_gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dst_smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(__cvta_generic_to_global(src_gmem))
               : "memory");
#else
  *static_cast<uint4*>(dst_smem) = *static_cast<const uint4*>(src_gmem);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most kPending of this thread's most recent copy groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Two 16-bit values from two floats in one conversion instruction (round to nearest even, as
// from_f32); lo goes to the lower address.
template <typename T>
__device__ __forceinline__ uint32_t pack2_f32(float lo, float hi) {
  uint32_t u;
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&u, &h, 4);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&u, &h, 4);
  }
  return u;
}

// Both row sums over the G threads of a row group, every thread of the block calling (G is
// uniform). All lanes of a group get the same bits (butterfly, then the warps in order).
// red alternates between two buffers per row: a thread writes red[p] of row i + 2 only after
// the barrier of row i + 1, which every reader of red[p] for row i has passed.
__device__ __forceinline__ void pipe_row_sum(float (&s)[2], int G, float2 (&red)[kPipeMaxThreads / 32]) {
  for (int off = (G < 32 ? G : 32) / 2; off > 0; off >>= 1) {
    s[0] += __shfl_xor_sync(0xffffffffu, s[0], off);
    s[1] += __shfl_xor_sync(0xffffffffu, s[1], off);
  }
  if (G <= 32) return;
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = make_float2(s[0], s[1]);
  __syncthreads();
  const int first = (threadIdx.x / G) * (G / 32);
  float s0 = 0.f, s1 = 0.f;
  for (int w = 0; w < G / 32; ++w) {
    const float2 v = red[first + w];
    s0 += v.x;
    s1 += v.y;
  }
  s[0] = s0;
  s[1] = s1;
}

// Shared memory of norm_bwd_pipe_kernel: kPipeStages x tensors x kIters x threads chunks of 16
// bytes (slot (stage, tensor, k) of thread tid at ((stage * tensors + tensor) * kIters + k) *
// threads + tid: a warp's 32 slots are contiguous, no bank conflicts), then for kIters >= 4 the
// fp32 weight, 2 x kIters float4 per thread in the same thread-minor order.
size_t pipe_smem_bytes(int iters, int threads, bool dres) {
  const size_t tensors = dres ? 3 : 2;
  size_t bytes = kPipeStages * tensors * size_t(iters) * threads * 16;
  if (iters >= 4) bytes += size_t(iters) * threads * kPipeVec * sizeof(float);
  return bytes;
}

template <typename T, int kIters>
__global__ void __launch_bounds__(kPipeMaxThreads, 1) norm_bwd_pipe_kernel(const NormBackwardArgs a, const int G) {
  static_assert(sizeof(T) == 2, "16-bit x and dy only");
  constexpr int E = kIters * kPipeVec;  // columns per thread
  constexpr bool kWeightInSmem = kIters >= 4;
  using Chunk = Pack<T, kPipeVec>;
  extern __shared__ uint4 pipe_smem[];
  __shared__ float2 red[2][kPipeMaxThreads / 32];
  static_assert(sizeof(red) == kPipeStaticSmem);

  const int nthr = blockDim.x, tid = threadIdx.x;
  const int t = tid % G, g = tid / G, R = nthr / G;  // R rows per block at a time
  const int64_t cols = a.cols, nvec = cols / kPipeVec;
  const bool has_dres = a.dresidual_out != nullptr;
  const int tensors = has_dres ? 3 : 2;  // x, dy [, dresidual_out]
  uint4* const stage_base = pipe_smem + tid;
  auto slot = [&](int stage, int tensor, int k) { return stage_base + ((stage * tensors + tensor) * kIters + k) * nthr; };
  float4* const w_smem = reinterpret_cast<float4*>(pipe_smem + kPipeStages * tensors * kIters * nthr) + tid;
  auto owned = [&](int k) { return t + int64_t(k) * G < nvec; };  // chunk k of this thread is in the row

  // weight (1 without one) for this thread's columns, in fp32, once
  float w[kWeightInSmem ? 1 : kIters][kPipeVec];
  {
    auto load_w = [&]<typename TP>() {
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        float v[kPipeVec];
        if (owned(k) && a.weight != nullptr) {
          load_pack<TP, kPipeVec>(a.weight, (t + int64_t(k) * G) * kPipeVec, v);
        } else {
#pragma unroll
          for (int e = 0; e < kPipeVec; ++e) v[e] = 1.f;
        }
        if constexpr (kWeightInSmem) {
          w_smem[(2 * k) * nthr] = make_float4(v[0], v[1], v[2], v[3]);
          w_smem[(2 * k + 1) * nthr] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
#pragma unroll
          for (int e = 0; e < kPipeVec; ++e) w[k][e] = v[e];
        }
      }
    };
    switch (a.weight == nullptr ? DType::kFloat32 : a.param_dtype) {
      case DType::kFloat32: load_w.template operator()<float>(); break;
      case DType::kFloat16: load_w.template operator()<__half>(); break;
      case DType::kBFloat16: load_w.template operator()<__nv_bfloat16>(); break;
    }
  }
  auto weight = [&](int k, float (&v)[kPipeVec]) {
    if constexpr (kWeightInSmem) {  // written by this thread above: no barrier needed
      const float4 lo = w_smem[(2 * k) * nthr], hi = w_smem[(2 * k + 1) * nthr];
      v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
    } else {
#pragma unroll
      for (int e = 0; e < kPipeVec; ++e) v[e] = w[k][e];
    }
  };
  auto read_chunk = [&](int stage, int tensor, int k) {
    const uint4 raw = *slot(stage, tensor, k);
    Chunk c;
    memcpy(&c, &raw, sizeof(c));
    return c;
  };

  // Slots of chunks past the row's end are never copied into: zero them once, so both passes
  // run over every slot without a branch (x = dy = 0 there adds exactly 0 to the row sums, given
  // w = 1 and a finite xhat; a row whose xhat is not finite has no finite sums anyway). Only dx
  // stores and the partial-row writes test ownership.
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    if (owned(k)) continue;
    for (int stage = 0; stage < kPipeStages; ++stage)
      for (int tensor = 0; tensor < tensors; ++tensor) *slot(stage, tensor, k) = make_uint4(0u, 0u, 0u, 0u);
  }

  float dw[kIters][kPipeVec], db[kIters][kPipeVec];
#pragma unroll
  for (int k = 0; k < kIters; ++k)
#pragma unroll
    for (int e = 0; e < kPipeVec; ++e) dw[k][e] = db[k][e] = 0.f;

  // Iteration i handles row slot blockIdx.x + i * gridDim.x: rows slot * R + g. Every thread of the
  // block runs the same iterations (the row sums may synchronise the block).
  const int64_t slots = (a.rows + R - 1) / R;
  const int64_t iters = slots > blockIdx.x ? (slots - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  auto row_of = [&](int64_t i) { return (int64_t(blockIdx.x) + i * gridDim.x) * R + g; };
  auto has_row = [&](int64_t i) { return i < iters && row_of(i) < a.rows; };
  // Starts the copies of iteration i's row into stage i % kPipeStages and commits them as one
  // group (an empty group past the end, so the group count stays one per iteration).
  auto issue = [&](int64_t i) {
    if (has_row(i)) {
      const int stage = int(i % kPipeStages);
      const int64_t base = row_of(i) * cols;
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        if (!owned(k)) continue;
        const int64_t off = base + (t + int64_t(k) * G) * kPipeVec;
        cp_async16(slot(stage, 0, k), static_cast<const T*>(a.x) + off);
        cp_async16(slot(stage, 1, k), static_cast<const T*>(a.dy) + off);
        if (has_dres) cp_async16(slot(stage, 2, k), static_cast<const T*>(a.dresidual_out) + off);
      }
    }
    cp_async_commit();
  };
  // mean and rstd of iteration i's row, loaded one iteration ahead (their latency is not covered
  // by the copies, which may have landed long before)
  auto load_stats = [&](int64_t i, float& mean, float& rstd) {
    const bool ok = has_row(i);
    mean = ok && a.mean != nullptr ? a.mean[row_of(i)] : 0.f;
    rstd = ok ? a.rstd[row_of(i)] : 0.f;
  };

  const float inv_n = 1.f / float(cols);
  float next_mean, next_rstd;
  load_stats(0, next_mean, next_rstd);
#pragma unroll
  for (int s = 0; s < kPipeStages; ++s) issue(s);

  for (int64_t i = 0; i < iters; ++i) {
    const int stage = int(i % kPipeStages);
    const int64_t row = row_of(i);
    const bool valid = row < a.rows;
    const float mean = next_mean, rstd = next_rstd;
    load_stats(i + 1, next_mean, next_rstd);
    cp_async_wait<kPipeStages - 1>();  // this row's group has landed; the next one may still fly

    // pass 1: the row sums of g = dy * w and g * xhat, and this thread's dw/db sums
    float s[2] = {0.f, 0.f};
    if (valid) {
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const Chunk xc = read_chunk(stage, 0, k), dc = read_chunk(stage, 1, k);
        float wv[kPipeVec];
        weight(k, wv);
#pragma unroll
        for (int e = 0; e < kPipeVec; ++e) {
          const float xh = (elem_f32(xc, e) - mean) * rstd, d = elem_f32(dc, e), gw = d * wv[e];
          s[0] += gw * xh;
          s[1] += gw;
          dw[k][e] += d * xh;
          db[k][e] += d;
        }
      }
    }
    pipe_row_sum(s, G, red[i % 2]);
    const float c1 = s[0] * inv_n, c2 = a.is_rms ? 0.f : s[1] * inv_n;

    // pass 2: dx = rstd * (g - xhat * c1 - c2) [+ dresidual_out], written in x's dtype
    if (valid) {
      T* const dx = static_cast<T*>(a.dx) + row * cols;
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const Chunk xc = read_chunk(stage, 0, k), dc = read_chunk(stage, 1, k);
        float wv[kPipeVec], v[kPipeVec];
        weight(k, wv);
#pragma unroll
        for (int e = 0; e < kPipeVec; ++e) {
          const float xh = (elem_f32(xc, e) - mean) * rstd;
          v[e] = rstd * (elem_f32(dc, e) * wv[e] - xh * c1 - c2);
        }
        if (has_dres) {
          const Chunk rc = read_chunk(stage, 2, k);
#pragma unroll
          for (int e = 0; e < kPipeVec; ++e) v[e] += elem_f32(rc, e);
        }
        uint4 out;
        out.x = pack2_f32<T>(v[0], v[1]);
        out.y = pack2_f32<T>(v[2], v[3]);
        out.z = pack2_f32<T>(v[4], v[5]);
        out.w = pack2_f32<T>(v[6], v[7]);
        if (owned(k)) *reinterpret_cast<uint4*>(dx + (t + int64_t(k) * G) * kPipeVec) = out;
      }
    }
    // refill this stage (this thread's reads of it are done: their values fed the stores above)
    issue(i + kPipeStages);
  }
  cp_async_wait<0>();  // (only empty groups can be left; the buffer may be reused below)

  const bool want_dw = a.dweight_partial != nullptr, want_db = a.dbias_partial != nullptr;
  if (!want_dw && !want_db) return;
  if (R > 1) {
    // add the R row groups' sums in group order, through the idle staging buffer (2E floats per
    // thread fit: the staging holds 2 stages x at least 2 tensors x E 16-bit values per thread)
    float* const acc = reinterpret_cast<float*>(pipe_smem);
    __syncthreads();  // every thread is past its last read of its staging slots
#pragma unroll
    for (int k = 0; k < kIters; ++k)
#pragma unroll
      for (int e = 0; e < kPipeVec; ++e) {
        acc[(k * kPipeVec + e) * nthr + tid] = dw[k][e];
        acc[(E + k * kPipeVec + e) * nthr + tid] = db[k][e];
      }
    __syncthreads();
    if (g != 0) return;
#pragma unroll
    for (int k = 0; k < kIters; ++k)
#pragma unroll
      for (int e = 0; e < kPipeVec; ++e)
        for (int q = 1; q < R; ++q) {
          dw[k][e] += acc[(k * kPipeVec + e) * nthr + q * G + t];
          db[k][e] += acc[(E + k * kPipeVec + e) * nthr + q * G + t];
        }
  }
  float* const dwp = want_dw ? a.dweight_partial + int64_t(blockIdx.x) * cols : nullptr;
  float* const dbp = want_db ? a.dbias_partial + int64_t(blockIdx.x) * cols : nullptr;
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    if (!owned(k)) continue;
    const int64_t col = (t + int64_t(k) * G) * kPipeVec;
#pragma unroll
    for (int e = 0; e < kPipeVec; ++e) {
      if (want_dw) dwp[col + e] = dw[k][e];
      if (want_db) dbp[col + e] = db[k][e];
    }
  }
}

// out[c] = sum over blocks b of partial[b][c], in a fixed order: thread (x, y) adds the rows
// y, y + 16, ... of column strip x, then column x's 16 sums are added in order y = 0..15.
// blockIdx.y picks dweight (0) or dbias (1).
constexpr int kReduceCols = 32, kReduceRows = 16;
__global__ void norm_reduce_partials_kernel(const float* __restrict__ dw_partial, const float* __restrict__ db_partial,
                                            void* dw, void* db, DType out_dtype, int num_blocks, int64_t cols) {
  __shared__ float part[kReduceRows][kReduceCols + 1];
  const float* partial = blockIdx.y == 0 ? dw_partial : db_partial;
  void* out = blockIdx.y == 0 ? dw : db;
  if (partial == nullptr) return;
  const int64_t col = int64_t(blockIdx.x) * kReduceCols + threadIdx.x;
  float s = 0.f;
  if (col < cols) {
    for (int b = threadIdx.y; b < num_blocks; b += kReduceRows) s += partial[int64_t(b) * cols + col];
  }
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= cols) return;
  float total = 0.f;
#pragma unroll
  for (int y = 0; y < kReduceRows; ++y) total += part[y][threadIdx.x];
  float v[1] = {total};
  store_vec<1>(out, out_dtype, col, v);
}

// ------------------------------------------------------------------ launch configuration

int elem_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }
bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }
int next_pow2(int64_t v) {
  int p = 1;
  while (p < v) p *= 2;
  return p;
}
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Vector width: 16 bytes of x when every full-size tensor and the params allow it.
int fwd_vec(const NormForwardArgs& a) {
  const int v = 16 / elem_size(a.x_dtype);
  const bool ok = a.cols % v == 0 && aligned16(a.x) && aligned16(a.residual) && aligned16(a.weight) &&
                  aligned16(a.bias) && aligned16(a.out) && aligned16(a.residual_out);
  return ok ? v : 1;
}

int bwd_vec(const NormBackwardArgs& a) {
  const int v = 16 / elem_size(a.x_dtype);
  const bool ok = a.cols % v == 0 && aligned16(a.x) && aligned16(a.dy) && aligned16(a.weight) &&
                  aligned16(a.dresidual_out) && aligned16(a.dx) && aligned16(a.dresidual);
  return ok ? v : 1;
}

struct TileConfig {
  int vec, group, iters, threads;  // iters == 0: the looped kernel
};

// Up to 4 vectors (64 bytes of 16-bit x) per thread: enough loads in flight per thread, and
// the fewest threads per row (so most rows share no block-wide reductions). iters is 1..4, not
// rounded up to a power of two, so no register slot is wasted (N = 768: 32 threads x 3 vectors).
TileConfig fwd_config(const NormForwardArgs& a) {
  const int vec = fwd_vec(a);
  const int64_t nvec = a.cols / vec;
  if (nvec > int64_t(kFwdMaxGroup) * kFwdMaxIters) return {vec, 0, 0, kLoopedThreads};
  const int group = std::min(kFwdMaxGroup, next_pow2(ceil_div(nvec, kFwdMaxIters)));
  const int iters = int(ceil_div(nvec, group));
  return {vec, group, iters, std::max(group, 128)};
}

// At most 2 vectors per thread: x, dy, w and dx tiles stay in registers at 1024 threads.
TileConfig bwd_config(const NormBackwardArgs& a) {
  const int vec = bwd_vec(a);
  const int64_t nvec = a.cols / vec;
  if (nvec > int64_t(kBwdMaxGroup) * kBwdMaxIters) return {vec, 0, 0, kLoopedThreads};
  const int group = std::min(kBwdMaxGroup, next_pow2(ceil_div(nvec, kBwdMaxIters)));
  const int iters = next_pow2(ceil_div(nvec, group));
  return {vec, group, iters, std::max(group, 256)};
}

// The forward's common case, 16-bit x in 16-byte vectors (with or without a residual), has its
// group size as a compile-time constant (then G >= 32 goes with 3 or 4 vectors a thread): the
// butterfly unrolls and a thread's slot addresses are one pointer plus constant offsets. With a
// runtime G half of the instructions were integer and branch work, and at the 64-register cap
// nvcc split each 16-byte output store into four. G = 512 (N > 8192 at 16 bits) runs three
// blocks an SM (40 registers, a little spill) instead of two, except with fp32 params and 4
// vectors a thread (N = 16384), where two are faster; four blocks spill too much. With a residual
// (fp32 tile) one 512-thread block an SM.
// Runs f.template operator()<kGroup, kMinBlocks>() and returns true where such a variant exists.
template <typename F>
bool fwd_static_group(int group, bool three_blocks, F&& f) {
  switch (group) {
    case 32: f.template operator()<32, 2>(); return true;
    case 64: f.template operator()<64, 2>(); return true;
    case 128: f.template operator()<128, 2>(); return true;
    case 256: f.template operator()<256, 2>(); return true;
    case 512:
      if (three_blocks) {
        f.template operator()<512, 3>();
      } else {
        f.template operator()<512, 2>();
      }
      return true;
  }
  return false;
}

// Runs f.template operator()<T, kVec>() for x's dtype and the vector width (16 bytes or 1 element).
template <typename F>
cudaError_t dispatch_vec(DType x_dtype, int vec, F&& f) {
  return dispatch_dtype(x_dtype, [&]<typename T>() {
    if (vec == 1) return f.template operator()<T, 1>();
    return f.template operator()<T, 16 / sizeof(T)>();
  });
}

template <typename F>
cudaError_t dispatch_iters(int iters, F&& f) {
  switch (iters) {
    case 1: return f.template operator()<1>();
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    case 4: return f.template operator()<4>();
  }
  return cudaErrorInvalidConfiguration;
}

size_t bwd_smem(const TileConfig& c) { return size_t(2 * c.iters * c.vec + 1) * c.threads * sizeof(float); }

// Blocks of the persistent backward: as many as fit on the GPU at once, never more than there
// are row groups. Also sets the kernel's shared-memory limit when it needs more than 48 KiB.
cudaError_t bwd_blocks(const NormBackwardArgs& a, int num_sms, const TileConfig& c, int* blocks) {
  int per_sm = 0;
  cudaError_t err = dispatch_vec(a.x_dtype, c.vec, [&]<typename T, int kVec>() {
    if (c.iters == 0) {
      return occupancy(reinterpret_cast<const void*>(norm_bwd_looped_kernel<T, kVec>), c.threads, 0, &per_sm);
    }
    return dispatch_iters(c.iters, [&]<int kIters>() -> cudaError_t {
      if constexpr (kIters > kBwdMaxIters) {
        return cudaErrorInvalidConfiguration;
      } else {
        const auto kernel = norm_bwd_kernel<T, kVec, kIters>;
        // the limit of the instantiation's largest block (kBwdMaxGroup threads), set once per
        // device: a per-call value could shrink it under another host thread's launch
        static std::atomic<uint64_t> prepared{0};
        const cudaError_t e = once_per_device(prepared, [&] {
          int device = 0, optin = 0;
          cudaError_t r = cudaGetDevice(&device);
          if (r == cudaSuccess) r = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
          const size_t most = std::min(bwd_smem(TileConfig{kVec, 0, kIters, kBwdMaxGroup}), size_t(optin));
          if (r == cudaSuccess && most > 48 * 1024) {
            r = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(most));
          }
          return r;
        });
        if (e != cudaSuccess) return e;
        return occupancy(reinterpret_cast<const void*>(kernel), c.threads, bwd_smem(c), &per_sm);
      }
    });
  });
  if (err != cudaSuccess) return err;
  const int64_t groups = c.iters == 0 ? 1 : c.threads / c.group;
  const int64_t most = std::max<int64_t>(1, ceil_div(a.rows, groups));
  *blocks = int(std::min<int64_t>(most, int64_t(std::max(per_sm, 1)) * num_sms));
  return cudaSuccess;
}

// The pipelined backward's shape: iters chunks of 16 bytes per thread, G = group threads per row,
// threads per block, dynamic shared memory. iters == 0: these args take the other kernels.
struct PipeConfig {
  int iters, group, threads;
  size_t smem;
  size_t smem_limit;  // the kernel's dynamic shared-memory attribute: the same for every call of
                      // one instantiation, so concurrent host threads never shrink it under a launch
};

// Takes 16-bit x/dy in 16-byte chunks with dx (and dresidual_out, if any) in x's dtype and no
// separate dresidual; params of any dtype. Rows of up to 512 x 4 chunks (N = 16384 at 16 bits).
// kIters in 2..4 by a model of the used fraction of the SM: (owned slots / all slots) x
// (resident threads / 512), 512 being what ~128 registers per thread allow. E.g. N = 1536:
// 3 x 64 threads (2 blocks of 256 per SM) over 2 x 96 (2 x 192). Ties go to the most chunks a
// thread where a row still spans two warps or more (the same bytes in flight per SM, half the
// threads a row: fewer shuffles and barriers per byte), else to the fewest: at N = 1024, rows of
// one warp were slower with 4 chunks.
cudaError_t bwd_pipe_config(const NormBackwardArgs& a, PipeConfig* out) {
  *out = PipeConfig{0, 0, 0, 0, 0};
  if (a.x_dtype == DType::kFloat32 || bwd_vec(a) != kPipeVec) return cudaSuccess;
  if (a.dy_dtype != a.x_dtype || a.dx_dtype != a.x_dtype || a.dresidual != nullptr) return cudaSuccess;
  if (a.dresidual_out != nullptr && a.dresidual_out_dtype != a.x_dtype) return cudaSuccess;
  int device = 0, optin = 0, per_sm = 0;  // shared memory per block (opt-in) and per SM
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  if (err != cudaSuccess) return err;
  const int64_t nvec = a.cols / kPipeVec;
  PipeConfig best{0, 0, 0, 0, 0};
  int64_t best_num = 0, best_den = 1;  // the model's value, best_num / best_den
  for (int iters = 2; iters <= 4; ++iters) {
    const int64_t per = ceil_div(nvec, iters);
    const int64_t group = per <= 32 ? next_pow2(per) : ceil_div(per, 32) * 32;  // whole warps, or a power of two
    if (group > kPipeMaxThreads) continue;
    PipeConfig c{iters, int(group), 0, 0, 0};
    c.threads = c.group >= kPipeBlockThreads ? c.group : kPipeBlockThreads / c.group * c.group;
    c.smem = pipe_smem_bytes(c.iters, c.threads, a.dresidual_out != nullptr);
    if (c.smem + kPipeStaticSmem > size_t(optin)) continue;  // e.g. N = 16384 with dresidual_out
    const int64_t by_smem = int64_t(per_sm) / int64_t(c.smem + kPipeStaticSmem + 1024);  // 1 KiB reserved per block
    const int64_t blocks = std::min<int64_t>(kPipeMaxThreads / c.threads, by_smem);
    const int64_t num = nvec * blocks * c.threads, den = iters * group;  // (nvec / slots) x resident threads
    const int64_t lhs = num * best_den, rhs = best_num * den;  // this config's value against the best's
    if (blocks > 0 && (best.iters == 0 || lhs > rhs || (lhs == rhs && group >= 64))) {
      best = c;
      best_num = num;
      best_den = den;
    }
  }
  if (best.iters == 0) return cudaSuccess;
  best.smem_limit = std::min(pipe_smem_bytes(best.iters, kPipeMaxThreads, true), size_t(optin) - kPipeStaticSmem);
  *out = best;
  return cudaSuccess;
}

// Runs f.template operator()<T, kIters>() for the pipelined kernel's 16-bit dtypes.
template <typename F>
cudaError_t dispatch_pipe(DType x_dtype, int iters, F&& f) {
  auto by_iters = [&]<typename T>() -> cudaError_t {
    switch (iters) {
      case 2: return f.template operator()<T, 2>();
      case 3: return f.template operator()<T, 3>();
      case 4: return f.template operator()<T, 4>();
    }
    return cudaErrorInvalidConfiguration;
  };
  switch (x_dtype) {
    case DType::kFloat16: return by_iters.template operator()<__half>();
    case DType::kBFloat16: return by_iters.template operator()<__nv_bfloat16>();
    default: return cudaErrorInvalidValue;
  }
}

// Opens the kernel's shared-memory limit (and prefers shared memory over L1: the kernel streams
// through shared memory and keeps its weight in registers); per_sm (optional): blocks per SM.
// Both attributes take one value per device (smem_limit is the instantiation's), so they are set
// at its first call on a device.
template <typename T, int kIters>
cudaError_t pipe_prepare(const PipeConfig& c, int* per_sm) {
  const auto kernel = norm_bwd_pipe_kernel<T, kIters>;
  static std::atomic<uint64_t> prepared{0};
  cudaError_t err = once_per_device(prepared, [&] {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(c.smem_limit));
    return e != cudaSuccess ? e : cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                       int(cudaSharedmemCarveoutMaxShared));
  });
  if (err == cudaSuccess && per_sm != nullptr) {
    err = occupancy(reinterpret_cast<const void*>(kernel), c.threads, c.smem, per_sm);
  }
  return err;
}

}  // namespace

cudaError_t norm_forward(const NormForwardArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  const TileConfig c = fwd_config(a);
  return dispatch_vec(a.x_dtype, c.vec, [&]<typename T, int kVec>() {
    if (c.iters == 0) {
      if (a.rows > 0x7fffffff) return cudaErrorInvalidConfiguration;
      norm_fwd_looped_kernel<T, kVec><<<unsigned(a.rows), c.threads, 0, stream>>>(a);
      return cudaGetLastError();
    }
    const int64_t blocks = ceil_div(a.rows, c.threads / c.group);
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    return dispatch_iters(c.iters, [&]<int kIters>() {
      const auto run = [&]<bool kResidual>() {
        // with a residual (an fp32 tile) one block an SM, whatever fwd_static_group asks
        const auto launch = [&]<int kGroup, int kMinBlocks>() {
          const auto kernel = norm_fwd_kernel<T, kResidual, kVec, kIters, kGroup, kResidual ? 1 : kMinBlocks>;
          kernel<<<unsigned(blocks), c.threads, 0, stream>>>(a, c.group);
        };
        if constexpr (sizeof(T) == 2 && kVec == 8 && kIters >= 3) {
          const bool three_blocks = !kResidual && !(kIters == 4 && a.param_dtype == DType::kFloat32);
          if (fwd_static_group(c.group, three_blocks, launch)) return;
        }
        launch.template operator()<0, 2>();
      };
      if (a.residual != nullptr) {
        run.template operator()<true>();
      } else {
        run.template operator()<false>();
      }
      return cudaGetLastError();
    });
  });
}

cudaError_t norm_backward_blocks(const NormBackwardArgs& a, int num_sms, int* blocks) {
  if (a.rows == 0 || a.cols == 0) {
    *blocks = 1;
    return cudaSuccess;
  }
  PipeConfig p;
  cudaError_t err = bwd_pipe_config(a, &p);
  if (err != cudaSuccess) return err;
  if (p.iters == 0) return bwd_blocks(a, num_sms, bwd_config(a), blocks);
  // as many blocks as fit on the GPU at once, never more than there are row slots
  int per_sm = 0;
  err = dispatch_pipe(a.x_dtype, p.iters, [&]<typename T, int kIters>() { return pipe_prepare<T, kIters>(p, &per_sm); });
  if (err != cudaSuccess) return err;
  const int64_t slots = ceil_div(a.rows, p.threads / p.group);
  *blocks = int(std::min<int64_t>(slots, int64_t(std::max(per_sm, 1)) * num_sms));
  return cudaSuccess;
}

cudaError_t norm_backward(const NormBackwardArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  if (a.num_blocks < 1) return cudaErrorInvalidConfiguration;
  PipeConfig p;
  const cudaError_t err = bwd_pipe_config(a, &p);
  if (err != cudaSuccess) return err;
  if (p.iters != 0) {
    return dispatch_pipe(a.x_dtype, p.iters, [&]<typename T, int kIters>() {
      const cudaError_t e = pipe_prepare<T, kIters>(p, nullptr);
      if (e != cudaSuccess) return e;
      norm_bwd_pipe_kernel<T, kIters><<<unsigned(a.num_blocks), p.threads, p.smem, stream>>>(a, p.group);
      return cudaGetLastError();
    });
  }
  const TileConfig c = bwd_config(a);
  return dispatch_vec(a.x_dtype, c.vec, [&]<typename T, int kVec>() {
    if (c.iters == 0) {
      norm_bwd_looped_kernel<T, kVec><<<unsigned(a.num_blocks), c.threads, 0, stream>>>(a);
      return cudaGetLastError();
    }
    return dispatch_iters(c.iters, [&]<int kIters>() -> cudaError_t {
      if constexpr (kIters > kBwdMaxIters) {
        return cudaErrorInvalidConfiguration;
      } else {
        norm_bwd_kernel<T, kVec, kIters><<<unsigned(a.num_blocks), c.threads, bwd_smem(c), stream>>>(a, c.group);
        return cudaGetLastError();
      }
    });
  });
}

cudaError_t norm_reduce_partials(const float* dweight_partial, const float* dbias_partial, void* dweight,
                                 void* dbias, DType param_dtype, int num_blocks, int64_t cols, cudaStream_t stream) {
  if (cols == 0 || (dweight_partial == nullptr && dbias_partial == nullptr)) return cudaSuccess;
  const int64_t strips = ceil_div(cols, kReduceCols);
  if (strips > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid{unsigned(strips), 2};
  const dim3 block{kReduceCols, kReduceRows};
  norm_reduce_partials_kernel<<<grid, block, 0, stream>>>(dweight_partial, dbias_partial, dweight, dbias,
                                                         param_dtype, num_blocks, cols);
  return cudaGetLastError();
}

}  // namespace ampk
