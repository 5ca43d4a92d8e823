// CPU emulator for the CUDA kernels of layer_norm.cu: one std::thread per CUDA thread, blocks one
// after another. __syncthreads = std::barrier over the block, __shfl_xor_sync through a per-warp
// exchange buffer and barrier, cp.async either immediate or deferred to the wait (with the
// destination poisoned at issue, so a read before the wait sees NaN).
#pragma once
inline int emu_optin = 232448;
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)

namespace emu {
struct Block {
  std::unique_ptr<std::barrier<>> bar;
  std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
  std::vector<float> xchg;
};
struct Copy { void* dst; unsigned char bytes[16]; };
inline thread_local dim3 t_idx, b_idx, b_dim, g_dim;
inline thread_local Block* t_block = nullptr;
inline thread_local std::vector<Copy> t_pending;
inline thread_local std::vector<std::vector<Copy>> t_groups;
inline std::vector<unsigned char> g_dyn;
inline bool g_deferred = true;   // cp.async mode
inline long g_launches = 0;
inline void* dyn_smem() { return g_dyn.data(); }
inline int tid() { return int(t_idx.x + b_dim.x * (t_idx.y + b_dim.y * t_idx.z)); }

inline void cp_async16(void* dst, const void* src) {
  Copy c{dst, {}};
  std::memcpy(c.bytes, src, 16);
  if (!g_deferred) { std::memcpy(dst, c.bytes, 16); return; }
  std::memset(dst, 0xff, 16);  // poison: 16-bit NaN until the wait
  t_pending.push_back(c);
}
inline void cp_async_commit() { t_groups.push_back(std::move(t_pending)); t_pending.clear(); }
inline void cp_async_wait(int pending) {
  while (int(t_groups.size()) > pending) {
    for (const Copy& c : t_groups.front()) std::memcpy(c.dst, c.bytes, 16);
    t_groups.erase(t_groups.begin());
  }
}

template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t, Args... args) {
  ++g_launches;
  const int n = int(block.x * block.y * block.z);
  if (n % 32 != 0 && n > 32) { std::fprintf(stderr, "block of %d threads\n", n); std::abort(); }
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        g_dyn.assign(smem + 16, 0xff);  // uninitialised shared memory reads as NaN
        Block b;
        b.bar = std::make_unique<std::barrier<>>(n);
        for (int w = 0; w < (n + 31) / 32; ++w) b.warp_bar.push_back(std::make_unique<std::barrier<>>(std::min(32, n - 32 * w)));
        b.xchg.assign(n, 0.f);
        std::vector<std::thread> th;
        th.reserve(n);
        for (int i = 0; i < n; ++i) {
          th.emplace_back([&, i] {
            t_block = &b;
            t_idx = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
            b_idx = dim3(bx, by, bz);
            b_dim = block;
            g_dim = grid;
            t_pending.clear();
            t_groups.clear();
            kernel(args...);
            if (!t_pending.empty() || !t_groups.empty()) {
              // groups left unwaited at exit: fine on the GPU only if nothing reads them
              for (auto& g : t_groups) if (!g.empty()) { std::fprintf(stderr, "thread exits with copies in flight\n"); std::abort(); }
            }
            b.warp_bar[i / 32]->arrive_and_drop();
            b.bar->arrive_and_drop();
          });
        }
        for (auto& t : th) t.join();
      }
}
}  // namespace emu

#define threadIdx emu::t_idx
#define blockIdx emu::b_idx
#define blockDim emu::b_dim
#define gridDim emu::g_dim

inline void __syncthreads() { emu::t_block->bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask, int width = 32) {
  if (mask != 0xffffffffu || width != 32) std::abort();
  emu::Block* b = emu::t_block;
  const int t = emu::tid(), w = t / 32;
  b->xchg[t] = v;
  b->warp_bar[w]->arrive_and_wait();
  const float r = b->xchg[(t & ~31) | ((t & 31) ^ lane_mask)];
  b->warp_bar[w]->arrive_and_wait();
  return r;
}
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
// runtime API for kernels given as function pointers (cuda_runtime.h has these only under nvcc)
template <class T>
cudaError_t cudaFuncSetAttribute(T*, cudaFuncAttribute, int) { return cudaSuccess; }
namespace emu { inline int g_regs = 128; }
template <class T>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, T*, int threads, size_t smem) {
  int a = 2048 / threads, b = 65536 / (emu::g_regs * threads), c = int(233472 / (smem + 1024));
  *n = std::min(a, std::min(b, c));
  return cudaSuccess;
}
