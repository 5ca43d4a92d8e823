// Fused bias + activation, forward and backward: the elementwise half of linear_act's
// unfused path (GEMM, then this), and the kernel that proves the build end to end.
//
// Forward: a thread owns kUnroll vectors of kVec consecutive elements of one row a step (16-byte
// loads when cols and pointers allow, else 1 element); y = act(z + bias), pre = z + bias.
// Backward: a block owns a 32-column strip of one row chunk; it writes dz = dy*act'(pre)
// and the fp32 column sums of its chunk to dbias_partial[chunk]; reduce_partials then
// adds the chunks in a fixed order, so dbias is bitwise repeatable.
#include <algorithm>

#include "activations.cuh"

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
      if constexpr (kVec > 1) {
        *reinterpret_cast<uint4*>(zv[u]) = *reinterpret_cast<const uint4*>(z + i);
      } else {
        zv[u][0] = z[i];
      }
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
      if constexpr (kVec > 1) {
        *reinterpret_cast<uint4*>(y + i) = *reinterpret_cast<const uint4*>(yv);
        if (pre != nullptr) *reinterpret_cast<uint4*>(pre + i) = *reinterpret_cast<const uint4*>(zv[u]);
      } else {
        y[i] = yv[0];
        if (pre != nullptr) pre[i] = zv[u][0];
      }
    }
  }
}

constexpr int kStripCols = 32;  // columns per backward block (one warp wide)
constexpr int kStripRows = 8;   // warps per backward block

template <typename T, Activation A>
__global__ void bias_act_backward_kernel(const T* __restrict__ dy, const T* __restrict__ pre, T* __restrict__ dz,
                                         float* __restrict__ dbias_partial, int64_t rows, int64_t cols,
                                         int64_t rows_per_chunk) {
  __shared__ float sums[kStripRows][kStripCols + 1];
  const int64_t col = int64_t(blockIdx.x) * kStripCols + threadIdx.x;
  const int64_t row_begin = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t row_end = min(rows, row_begin + rows_per_chunk);
  float acc = 0.f;
  if (col < cols) {
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kStripRows) {
      const int64_t i = r * cols + col;
      const float g = to_f32(dy[i]) * act_grad<A>(to_f32(pre[i]));
      const T gt = from_f32<T>(g);
      dz[i] = gt;
      acc += to_f32(gt);  // dbias = sum of dz as stored, like torch's dz.sum(0)
    }
  }
  if (dbias_partial == nullptr) return;
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < kStripRows; ++k) total += sums[k][threadIdx.x];
    dbias_partial[int64_t(blockIdx.y) * cols + col] = total;
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

int bias_act_backward_chunks(int64_t rows, int64_t cols, int num_sms) {
  const int64_t strips = (cols + kStripCols - 1) / kStripCols;
  const int64_t want = std::max<int64_t>(1, (int64_t(num_sms) * 8 + strips - 1) / strips);  // ~8 blocks per SM
  const int64_t most = std::max<int64_t>(1, (rows + kStripRows - 1) / kStripRows);          // >= 1 row per warp
  return int(std::min<int64_t>({want, most, int64_t(65535)}));
}

cudaError_t bias_act_backward(const void* dy, const void* pre, void* dz, float* dbias_partial, int64_t rows,
                              int64_t cols, int num_chunks, DType dtype, Activation act, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const int64_t strips = (cols + kStripCols - 1) / kStripCols;
  if (strips > 0x7fffffff || num_chunks < 1 || num_chunks > 65535) return cudaErrorInvalidConfiguration;
  const int64_t rows_per_chunk = (rows + num_chunks - 1) / num_chunks;
  return dispatch_dtype(dtype, [&]<typename T>() {
    return dispatch_activation(act, [&]<Activation A>() {
      const dim3 grid{unsigned(strips), unsigned(num_chunks)};
      const dim3 block{kStripCols, kStripRows};
      bias_act_backward_kernel<T, A><<<grid, block, 0, stream>>>(static_cast<const T*>(dy),
                                                                 static_cast<const T*>(pre), static_cast<T*>(dz),
                                                                 dbias_partial, rows, cols, rows_per_chunk);
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

#define AMPK_STR2(x) #x
#define AMPK_STR(x) AMPK_STR2(x)
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
