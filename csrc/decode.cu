// Fused forward-only ops of the native rollout engine's decode step (verl_mcore/rollout/native.py).
//
// A decode step runs one token per sequence through every layer, so each op touches little data
// and the step is a long chain of small kernels; inside a CUDA graph their launch cost is gone but
// each still costs a few microseconds of device time. These kernels replace the longest chains:
//
//   rmsnorm:     [residual +=] delta; out = rmsnorm(residual) * weight      (torch: ~8 kernels)
//   uniforms:    the sampler's counter-based uniform per sequence (splitmix64 of key and step, in
//                uint64 arithmetic)                                  (torch on int64: ~60 kernels)
//   rope_cache:  split the fused QKV row, rotate q and k, write k and v into each token's row of the
//                (paged) KV cache and q into a [tokens, heads, hd] buffer     (torch: ~16 kernels)
//   swiglu:      out = silu(x[:, :f]) * x[:, f:] of the MLP's fused gate/up rows  (torch: 2 kernels)
//
// Rounding follows the torch expressions they replace, so a bf16 result differs from torch's only
// where torch's own reductions order their sums differently: rmsnorm computes in float and rounds
// x * rstd to the activation dtype before multiplying by the weight (torch's rms_norm); the rotary
// sum is round(round(x * cos) + round(rotate_half(x) * sin)) as `q * cos + rotate_half(q) * sin`;
// swiglu rounds silu(gate) to T before the product, as `F.silu(gate) * up` does.
#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "float_types.cuh"
#include "kernels.h"

namespace verl_mcore {
namespace {

constexpr int kNormThreads = 256;
constexpr int kRopeThreads = 128;

// Rounds a float to T's precision and back (the value torch would store in a T tensor).
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float<T>(from_float<T>(x)); }

__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  v = lane < warps ? scratch[lane] : 0.f;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;  // every thread holds the sum
}

// One block a row. With `delta`, the residual row is first updated in place (residual += delta,
// rounded to T as a torch add is) and normalised after.
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
rmsnorm_kernel(T* __restrict__ residual, const T* __restrict__ delta, const T* __restrict__ weight,
               T* __restrict__ out, int64_t hidden, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  T* h = residual + row * hidden;
  const T* d = delta ? delta + row * hidden : nullptr;
  T* y = out + row * hidden;
  float sq = 0.f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = to_float<T>(h[i]);
    if (d) {
      v = round_to<T>(v + to_float<T>(d[i]));
      h[i] = from_float<T>(v);
    }
    sq = fmaf(v, v, sq);
  }
  const float rstd = rsqrtf(block_sum(sq, scratch) / float(hidden) + eps);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    // Each thread rereads the elements it wrote itself above: no other thread's writes are needed.
    const float normed = round_to<T>(to_float<T>(h[i]) * rstd);
    y[i] = from_float<T>(normed * to_float<T>(weight[i]));
  }
}

// One block per (token, KV group). The group's slice of the QKV row holds `r` query heads, then
// its key head, then its value head (megatron's group-interleaved layout), each `hd` wide.
template <typename T>
__global__ void __launch_bounds__(kRopeThreads)
rope_cache_kernel(const T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ sin,
                  const int64_t* __restrict__ positions, const int64_t* __restrict__ rows, T* __restrict__ q_out,
                  T* __restrict__ cache_k, T* __restrict__ cache_v, int groups, int r, int hd) {
  const int64_t tok = blockIdx.x / groups;
  const int g = blockIdx.x % groups;
  const int64_t pos = positions[tok];
  const T* row = qkv + (tok * groups + g) * int64_t(r + 2) * hd;
  const T* c = cos + pos * hd;
  const T* s = sin + pos * hd;
  const int half = hd / 2;
  // cache layout [cache rows, groups, hd]: token `tok` writes row rows[tok] (its block and offset).
  const int64_t cache_off = (rows[tok] * groups + g) * hd;
  for (int e = threadIdx.x; e < (r + 2) * hd; e += blockDim.x) {
    const int head = e / hd, i = e % hd;
    const float x = to_float<T>(row[e]);
    if (head == r + 1) {
      cache_v[cache_off + i] = row[e];
      continue;
    }
    const T* base = row + head * hd;
    const float partner = i < half ? -to_float<T>(base[i + half]) : to_float<T>(base[i - half]);
    const float rotated = round_to<T>(round_to<T>(x * to_float<T>(c[i])) + round_to<T>(partner * to_float<T>(s[i])));
    if (head == r) {
      cache_k[cache_off + i] = from_float<T>(rotated);
    } else {
      q_out[((tok * groups + g) * r + head) * int64_t(hd) + i] = from_float<T>(rotated);
    }
  }
}

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// verl_mcore/rollout/sampling.py `uniforms`: 53 random bits of mix64(key ^ mix64(step * golden + 1)).
__global__ void uniforms_kernel(const int64_t* __restrict__ keys, const int64_t* __restrict__ steps,
                                double* __restrict__ out, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const uint64_t step = static_cast<uint64_t>(steps[i]);
  const uint64_t bits = mix64(static_cast<uint64_t>(keys[i]) ^ mix64(step * 0x9E3779B97F4A7C15ull + 1ull));
  out[i] = double(bits >> 11) * (1.0 / 9007199254740992.0);  // / 2^53
}

template <typename T>
cudaError_t rmsnorm_typed(void* residual, const void* delta, const void* weight, void* out, int64_t rows,
                          int64_t hidden, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  rmsnorm_kernel<T><<<unsigned(rows), kNormThreads, 0, stream>>>(
      static_cast<T*>(residual), static_cast<const T*>(delta), static_cast<const T*>(weight),
      static_cast<T*>(out), hidden, eps);
  return cudaGetLastError();
}

template <typename T>
cudaError_t rope_cache_typed(const void* qkv, const void* cos, const void* sin, const int64_t* positions,
                             const int64_t* rows, void* q_out, void* cache_k, void* cache_v, int64_t tokens, int groups,
                             int r, int hd, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  rope_cache_kernel<T><<<unsigned(tokens * groups), kRopeThreads, 0, stream>>>(
      static_cast<const T*>(qkv), static_cast<const T*>(cos), static_cast<const T*>(sin), positions, rows,
      static_cast<T*>(q_out), static_cast<T*>(cache_k), static_cast<T*>(cache_v), groups, r, hd);
  return cudaGetLastError();
}

// Elements a thread handles: 16 bytes of T (the widest load), or 4 floats.
template <typename T> constexpr int kVec = 16 / sizeof(T);

template <typename T> __device__ __forceinline__ float swiglu_one(T gate, T up) {
  const float g = to_float<T>(gate);
  return round_to<T>(g / (1.f + __expf(-g))) * to_float<T>(up);
}

// Grid-stride over the output's `rows * f` elements, kVec<T> at a time along a row when `vec`
// (f a multiple of kVec<T>, x and out 16-byte aligned), else one at a time.
template <typename T>
__global__ void swiglu_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows, int64_t f, bool vec) {
  constexpr int V = kVec<T>;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if (vec) {
    const int64_t per_row = f / V, n = rows * per_row;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
      const int64_t row = i / per_row, col = (i % per_row) * V;
      const T* gate = x + row * 2 * f + col;
      alignas(16) T g[V], u[V], y[V];
      *reinterpret_cast<uint4*>(g) = *reinterpret_cast<const uint4*>(gate);
      *reinterpret_cast<uint4*>(u) = *reinterpret_cast<const uint4*>(gate + f);
#pragma unroll
      for (int k = 0; k < V; ++k) y[k] = from_float<T>(swiglu_one<T>(g[k], u[k]));
      *reinterpret_cast<uint4*>(out + row * f + col) = *reinterpret_cast<const uint4*>(y);
    }
    return;
  }
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * f; i += stride) {
    const int64_t row = i / f, col = i % f;
    out[i] = from_float<T>(swiglu_one<T>(x[row * 2 * f + col], x[row * 2 * f + f + col]));
  }
}

template <typename T>
cudaError_t swiglu_typed(const void* x, void* out, int64_t rows, int64_t f, cudaStream_t stream) {
  if (rows == 0 || f == 0) return cudaSuccess;
  constexpr int threads = 256;
  const bool vec = f % kVec<T> == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t work = vec ? rows * (f / kVec<T>) : rows * f;
  const int blocks = int(std::min<int64_t>((work + threads - 1) / threads, 65535));
  swiglu_kernel<T><<<blocks, threads, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(out), rows, f, vec);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rmsnorm_launch(void* residual, const void* delta, const void* weight, void* out, FloatDtype dtype,
                           int64_t rows, int64_t hidden, float eps, cudaStream_t stream) {
  switch (dtype) {
    case FloatDtype::kFloat32: return rmsnorm_typed<float>(residual, delta, weight, out, rows, hidden, eps, stream);
    case FloatDtype::kBFloat16:
      return rmsnorm_typed<__nv_bfloat16>(residual, delta, weight, out, rows, hidden, eps, stream);
    case FloatDtype::kFloat16: return rmsnorm_typed<__half>(residual, delta, weight, out, rows, hidden, eps, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t uniforms_launch(const int64_t* keys, const int64_t* steps, double* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int threads = 256;
  uniforms_kernel<<<unsigned((n + threads - 1) / threads), threads, 0, stream>>>(keys, steps, out, n);
  return cudaGetLastError();
}

cudaError_t rope_cache_launch(const void* qkv, const void* cos, const void* sin, const int64_t* positions,
                              const int64_t* rows, void* q_out, void* cache_k, void* cache_v, FloatDtype dtype,
                              int64_t tokens, int groups, int r, int hd, cudaStream_t stream) {
  switch (dtype) {
    case FloatDtype::kFloat32:
      return rope_cache_typed<float>(qkv, cos, sin, positions, rows, q_out, cache_k, cache_v, tokens, groups, r, hd,
                                     stream);
    case FloatDtype::kBFloat16:
      return rope_cache_typed<__nv_bfloat16>(qkv, cos, sin, positions, rows, q_out, cache_k, cache_v, tokens, groups,
                                             r, hd, stream);
    case FloatDtype::kFloat16:
      return rope_cache_typed<__half>(qkv, cos, sin, positions, rows, q_out, cache_k, cache_v, tokens, groups, r, hd,
                                      stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t swiglu_launch(const void* x, void* out, FloatDtype dtype, int64_t rows, int64_t f,
                          cudaStream_t stream) {
  switch (dtype) {
    case FloatDtype::kFloat32: return swiglu_typed<float>(x, out, rows, f, stream);
    case FloatDtype::kBFloat16: return swiglu_typed<__nv_bfloat16>(x, out, rows, f, stream);
    case FloatDtype::kFloat16: return swiglu_typed<__half>(x, out, rows, f, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace verl_mcore
