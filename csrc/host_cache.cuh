// Host-side answers that never change for a (kernel, device) pair, kept so that a launcher does
// not pay a driver query on every call (small calls are host-bound).
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>

#include <cuda_runtime.h>

namespace ampk {

// cudaOccupancyMaxActiveBlocksPerMultiprocessor, remembered per (kernel, device, threads, dynamic
// shared memory). The answer is fixed once the kernel's attributes are (they are set to one
// value per device before its first query).
inline cudaError_t occupancy(const void* kernel, int threads, size_t smem, int* per_sm) {
  struct Key {
    const void* kernel;
    int device, threads;
    size_t smem;
    bool operator==(const Key& o) const {
      return kernel == o.kernel && device == o.device && threads == o.threads && smem == o.smem;
    }
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.kernel) ^ (size_t(k.device) << 48) ^ (size_t(k.threads) << 32) ^ k.smem;
    }
  };
  static std::mutex mutex;
  static std::unordered_map<Key, int, Hash> known;
  Key key{kernel, 0, threads, smem};
  cudaError_t err = cudaGetDevice(&key.device);
  if (err != cudaSuccess) return err;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = known.find(key);
    if (it != known.end()) {
      *per_sm = it->second;
      return cudaSuccess;
    }
  }
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, threads, smem);
  if (err != cudaSuccess) return err;
  const std::lock_guard<std::mutex> lock(mutex);
  known.emplace(key, *per_sm);
  return cudaSuccess;
}

// The current device's bit in a per-device "done" mask (up to 64 devices; 0 past that or on
// error, so a caller redoes its once-per-device work every call there).
inline uint64_t device_bit() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= 64) return 0;
  return uint64_t(1) << device;
}

// Runs set_attributes() (kernel attributes that take one value per device) at the first call
// on each device, and again after a failure.
template <typename F>
cudaError_t once_per_device(std::atomic<uint64_t>& done, F&& set_attributes) {
  const uint64_t bit = device_bit();
  if (bit != 0 && (done.load() & bit) != 0) return cudaSuccess;
  const cudaError_t err = set_attributes();
  if (err == cudaSuccess) done.fetch_or(bit);
  return err;
}

}  // namespace ampk
