// Rotary position embedding (the rotate-half form of GPT-NeoX and Hugging Face's LLaMA family),
// forward and backward, over one 4-D tensor whose last dim is the head dim:
//   forward:  out[..., i] = x[i] cos[i] - x[i + h] sin[i],  out[..., i + h] = x[i + h] cos[i + h] + x[i] sin[i + h]
//   backward: dx[..., i] = g[i] cos[i] + g[i + h] sin[i + h], dx[..., i + h] = g[i + h] cos[i + h] - g[i] sin[i]
// (h = head_dim / 2), fp32 math, one rounding per output. x, cos, sin and out are strided (last dim
// contiguous); cos and sin come broadcast to x's shape (stride 0 on the broadcast dims), so one
// kernel serves q and k of any head count and both layouts (heads before or after the sequence).
// A block's threads cover a row's pairs (x) and several rows (y); memory-bound, no shared memory.
#include <algorithm>

#include "activations.cuh"

namespace ampk {
namespace {

__device__ __forceinline__ float load_any(const void* p, int64_t i, DType t) {
  switch (t) {
    case DType::kFloat16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

template <typename TX, typename TO, bool kBackward>
__global__ void rotary_kernel(RotaryArgs a) {
  const int64_t half = a.head_dim / 2;
  for (int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; row < a.rows;
       row += int64_t(gridDim.x) * blockDim.y) {
    const int64_t i2 = row % a.size2, rest = row / a.size2, i1 = rest % a.size1, i0 = rest / a.size1;
    const TX* x = static_cast<const TX*>(a.x) + i0 * a.x_stride[0] + i1 * a.x_stride[1] + i2 * a.x_stride[2];
    TO* out = static_cast<TO*>(a.out) + i0 * a.out_stride[0] + i1 * a.out_stride[1] + i2 * a.out_stride[2];
    const int64_t c = i0 * a.cos_stride[0] + i1 * a.cos_stride[1] + i2 * a.cos_stride[2];
    const int64_t s = i0 * a.sin_stride[0] + i1 * a.sin_stride[1] + i2 * a.sin_stride[2];
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      const float x1 = to_f32(x[i]), x2 = to_f32(x[i + half]);
      const float c1 = load_any(a.cos, c + i, a.cs_dtype), c2 = load_any(a.cos, c + i + half, a.cs_dtype);
      const float s1 = load_any(a.sin, s + i, a.cs_dtype), s2 = load_any(a.sin, s + i + half, a.cs_dtype);
      float o1, o2;
      if constexpr (kBackward) {
        o1 = x1 * c1 + x2 * s2;
        o2 = x2 * c2 - x1 * s1;
      } else {
        o1 = x1 * c1 - x2 * s1;
        o2 = x2 * c2 + x1 * s2;
      }
      out[i] = from_f32<TO>(o1);
      out[i + half] = from_f32<TO>(o2);
    }
  }
}

template <typename TX, typename TO>
cudaError_t launch(const RotaryArgs& a, int num_sms, cudaStream_t stream) {
  const int64_t half = a.head_dim / 2;
  const int tx = int(std::min<int64_t>((half + 31) / 32 * 32, 128));
  const int ty = std::max(1, 256 / tx);
  const int64_t blocks = std::min<int64_t>((a.rows + ty - 1) / ty, int64_t(num_sms) * 32);
  const dim3 block(tx, ty);
  if (a.backward) {
    rotary_kernel<TX, TO, true><<<unsigned(blocks), block, 0, stream>>>(a);
  } else {
    rotary_kernel<TX, TO, false><<<unsigned(blocks), block, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename TX>
cudaError_t launch_out(const RotaryArgs& a, int num_sms, cudaStream_t stream) {
  switch (a.out_dtype) {
    case DType::kFloat16: return launch<TX, __half>(a, num_sms, stream);
    case DType::kBFloat16: return launch<TX, __nv_bfloat16>(a, num_sms, stream);
    default: return launch<TX, float>(a, num_sms, stream);
  }
}

}  // namespace

cudaError_t rotary(const RotaryArgs& args, int num_sms, cudaStream_t stream) {
  if (args.rows == 0 || args.head_dim == 0) return cudaSuccess;
  switch (args.x_dtype) {
    case DType::kFloat16: return launch_out<__half>(args, num_sms, stream);
    case DType::kBFloat16: return launch_out<__nv_bfloat16>(args, num_sms, stream);
    default: return launch_out<float>(args, num_sms, stream);
  }
}

}  // namespace ampk
