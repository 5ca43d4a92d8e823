// Fused bias + activation, forward and backward: the elementwise half of linear_act's
// unfused path (GEMM, then this), and the kernel that proves the build end to end.
//
// Forward: a thread owns kUnroll vectors of kVec consecutive elements of one row a step (16-byte
// loads when cols and pointers allow, else 1 element); y = act(z + bias), pre = z + bias.
// Backward with the bias gradient (without it, act_backward in linear_act.cu is the flat
// elementwise pass): a block owns a strip of 32 vectors (or 32 columns) of one row chunk; it
// writes dz = dy*act'(pre) and the fp32 column sums of its chunk to dbias_partial[chunk];
// reduce_partials then adds the chunks in a fixed order, so dbias is bitwise repeatable.
#include <algorithm>

#include "activations.cuh"
#include "host_cache.cuh"

namespace ampk {
namespace {

template <typename T, typename TB, Activation A, int kVec, int kUnroll>
__global__ void bias_act_forward_kernel(const T* __restrict__ z, const TB* __restrict__ bias, T* __restrict__ y,
                                        T* __restrict__ pre, int64_t numel, int64_t cols) {
  // kUnroll vectors a thread a step, all loaded before any is computed: more bytes in flight
  const int64_t step = int64_t(blockDim.x) * kVec;  // between a thread's vectors: each is coalesced
  const int64_t stride = int64_t(gridDim.x) * step * kUnroll;
  for (int64_t base = int64_t(blockIdx.x) * step * kUnroll + int64_t(threadIdx.x) * kVec; base < numel;
       base += stride) {
    T zv[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * step;
      if (i >= numel) break;
      copy_vec<kVec>(zv[u], z + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * step;
      if (i >= numel) break;
      const int64_t col = i % cols;  // kVec divides cols, so a vector never crosses a row
      T yv[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        float v = to_f32(zv[u][k]);
        if (bias != nullptr) v += to_f32(bias[col + k]);
        zv[u][k] = from_f32<T>(v);
        // act on the rounded pre-activation, as the unfused torch path (addmm then act) does
        yv[k] = from_f32<T>(act_fwd<A>(to_f32(zv[u][k])));
      }
      copy_vec<kVec>(y + i, yv);
      if (pre != nullptr) copy_vec<kVec>(pre + i, zv[u]);
    }
  }
}

constexpr int kStripVecs = 32;  // vectors across a backward block (one warp wide)
constexpr int kStripRows = 8;   // warps down a backward block

// A block owns a strip of kStripVecs vectors of kVec columns (16-byte loads when cols and the
// pointers allow, else kVec = 1) in one row chunk; its warps take every kStripRows-th row, each
// thread loading kUnroll rows' vectors before computing any (bytes in flight, as in the flat
// act' pass). The column sums stay in registers until the chunk is done: one cross-warp sum a
// block. dz may be dy (in place, act_backward_cuda_): a thread loads its elements before it
// stores them, and dy/dz carry no __restrict__ so the compiler is not told otherwise.
template <typename T, Activation A, int kVec, int kUnroll>
__global__ void bias_act_backward_kernel(const T* dy, const T* __restrict__ pre, T* dz,
                                         float* __restrict__ dbias_partial, int64_t rows, int64_t cols,
                                         int64_t rows_per_chunk) {
  constexpr int kCols = kStripVecs * kVec;
  __shared__ float sums[kStripRows][kCols + 1];
  const int64_t col = int64_t(blockIdx.x) * kCols + int64_t(threadIdx.x) * kVec;  // kVec divides cols
  const int64_t row_begin = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t row_end = min(rows, row_begin + rows_per_chunk);
  float acc[kVec] = {};
  if (col < cols) {
    for (int64_t r0 = row_begin + threadIdx.y; r0 < row_end; r0 += kStripRows * kUnroll) {
      T g[kUnroll][kVec], s[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t r = r0 + u * kStripRows;
        if (r >= row_end) break;
        copy_vec<kVec>(g[u], dy + r * cols + col);
        copy_vec<kVec>(s[u], pre + r * cols + col);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t r = r0 + u * kStripRows;
        if (r >= row_end) break;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          g[u][k] = from_f32<T>(to_f32(g[u][k]) * act_grad<A>(to_f32(s[u][k])));
          acc[k] += to_f32(g[u][k]);  // dbias = sum of dz as stored, like torch's dz.sum(0)
        }
        copy_vec<kVec>(dz + r * cols + col, g[u]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) sums[threadIdx.y][threadIdx.x * kVec + k] = acc[k];
  __syncthreads();
  // the strip's kCols column totals, over the warps in a fixed order, by all the block's threads
  for (int c = threadIdx.y * kStripVecs + threadIdx.x; c < kCols; c += kStripVecs * kStripRows) {
    const int64_t out_col = int64_t(blockIdx.x) * kCols + c;
    if (out_col >= cols) break;
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kStripRows; ++w) total += sums[w][c];
    dbias_partial[int64_t(blockIdx.y) * cols + out_col] = total;
  }
}

template <typename TO>
__global__ void reduce_partials_kernel(const float* __restrict__ partial, TO* __restrict__ out, int num_chunks,
                                       int64_t cols) {
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float total = 0.f;
  for (int c = 0; c < num_chunks; ++c) total += partial[int64_t(c) * cols + col];
  out[col] = from_f32<TO>(total);
}

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int grid_for(int64_t work_items, int threads) {
  // grid-stride loop: enough blocks to fill any current GPU, never more than needed
  return int(std::min<int64_t>((work_items + threads - 1) / threads, 65535LL * 8));
}

}  // namespace

cudaError_t bias_act_forward(const void* z, const void* bias, void* y, void* pre, int64_t rows, int64_t cols,
                             DType dtype, DType bias_dtype, Activation act, cudaStream_t stream) {
  const int64_t numel = rows * cols;
  if (numel == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&]<typename T>() {
    return dispatch_dtype(bias == nullptr ? dtype : bias_dtype, [&]<typename TB>() {
      return dispatch_activation(act, [&]<Activation A>() {
        constexpr int kWide = 16 / sizeof(T);
        constexpr int kThreads = 256;
        constexpr int kUnroll = 4;
        const bool vec = cols % kWide == 0 && aligned16(z) && aligned16(y) && aligned16(pre);
        if (vec) {
          bias_act_forward_kernel<T, TB, A, kWide, kUnroll>
              <<<grid_for(numel / kWide, kThreads * kUnroll), kThreads, 0, stream>>>(
                  static_cast<const T*>(z), static_cast<const TB*>(bias), static_cast<T*>(y), static_cast<T*>(pre),
                  numel, cols);
        } else {
          bias_act_forward_kernel<T, TB, A, 1, kUnroll><<<grid_for(numel, kThreads * kUnroll), kThreads, 0, stream>>>(
              static_cast<const T*>(z), static_cast<const TB*>(bias), static_cast<T*>(y), static_cast<T*>(pre),
              numel, cols);
        }
        return cudaGetLastError();
      });
    });
  });
}

constexpr int kBackwardUnroll = 4;

cudaError_t bias_act_backward_chunks(int64_t rows, int64_t cols, DType dtype, Activation act, int num_sms,
                                     int* chunks) {
  // As many blocks as the GPU holds at once (strips x chunks), so they run as one full wave:
  // blocks of equal work in 2.67 waves (8 an SM, 3 resident) would leave a third of the last
  // wave's slots idle. Strips as wide as bias_act_backward makes them when the pointers are
  // 16-byte aligned.
  return dispatch_dtype(dtype, [&]<typename T>() {
    return dispatch_activation(act, [&]<Activation A>() {
      constexpr int kWide = 16 / sizeof(T);
      const bool vec = cols % kWide == 0;
      int per_sm = 0;
      const cudaError_t err = occupancy(
          vec ? reinterpret_cast<const void*>(bias_act_backward_kernel<T, A, kWide, kBackwardUnroll>)
              : reinterpret_cast<const void*>(bias_act_backward_kernel<T, A, 1, kBackwardUnroll>),
          kStripVecs * kStripRows, 0, &per_sm);
      const int64_t strip = int64_t(kStripVecs) * (vec ? kWide : 1);
      const int64_t strips = (cols + strip - 1) / strip;
      const int64_t resident = int64_t(std::max(per_sm, 1)) * num_sms;
      const int64_t most = (rows + kStripRows - 1) / kStripRows;  // >= 1 row a warp
      *chunks = int(std::clamp<int64_t>(std::min(resident / strips, most), 1, 65535));
      return err;
    });
  });
}

cudaError_t bias_act_backward(const void* dy, const void* pre, void* dz, float* dbias_partial, int64_t rows,
                              int64_t cols, int num_chunks, DType dtype, Activation act, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (num_chunks < 1 || num_chunks > 65535) return cudaErrorInvalidConfiguration;
  const int64_t rows_per_chunk = (rows + num_chunks - 1) / num_chunks;
  return dispatch_dtype(dtype, [&]<typename T>() {
    return dispatch_activation(act, [&]<Activation A>() {
      constexpr int kWide = 16 / sizeof(T);
      constexpr int kUnroll = kBackwardUnroll;
      const bool vec = cols % kWide == 0 && aligned16(dy) && aligned16(pre) && aligned16(dz);
      const int64_t strip = int64_t(kStripVecs) * (vec ? kWide : 1);
      const int64_t strips = (cols + strip - 1) / strip;
      if (strips > 0x7fffffff) return cudaErrorInvalidConfiguration;
      const dim3 grid{unsigned(strips), unsigned(num_chunks)};
      const dim3 block{kStripVecs, kStripRows};
      if (vec) {
        bias_act_backward_kernel<T, A, kWide, kUnroll><<<grid, block, 0, stream>>>(
            static_cast<const T*>(dy), static_cast<const T*>(pre), static_cast<T*>(dz), dbias_partial, rows, cols,
            rows_per_chunk);
      } else {
        bias_act_backward_kernel<T, A, 1, kUnroll><<<grid, block, 0, stream>>>(
            static_cast<const T*>(dy), static_cast<const T*>(pre), static_cast<T*>(dz), dbias_partial, rows, cols,
            rows_per_chunk);
      }
      return cudaGetLastError();
    });
  });
}

cudaError_t reduce_partials(const float* partial, void* out, int num_chunks, int64_t cols, DType out_dtype,
                            cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  return dispatch_dtype(out_dtype, [&]<typename TO>() {
    constexpr int kThreads = 256;
    const int64_t blocks = (cols + kThreads - 1) / kThreads;
    reduce_partials_kernel<TO><<<unsigned(blocks), kThreads, 0, stream>>>(partial, static_cast<TO*>(out),
                                                                          num_chunks, cols);
    return cudaGetLastError();
  });
}

// variadic: with several architectures __CUDA_ARCH_LIST__ is a comma-separated list ("800,900")
#define AMPK_STR2(...) #__VA_ARGS__
#define AMPK_STR(...) AMPK_STR2(__VA_ARGS__)
const char* compiled_arch_list() {
#ifdef __CUDA_ARCH_LIST__
  return AMPK_STR(__CUDA_ARCH_LIST__);
#else
  return "unknown";
#endif
}

cudaError_t probe_kernel_image() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, reduce_partials_kernel<float>);
}

}  // namespace ampk
