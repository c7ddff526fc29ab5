// Vocab-parallel log-prob + entropy: forward statistics and backward grad-logits, one block a token.
//
// Forward: one pass over a token's logits row keeping, per thread, an online max m and the sums
// s = sum exp(z - m) and sd = sum exp(z - m) * (z - m) (z = logits * inv_temp), rescaled whenever
// the max grows; the threads' triples are then merged. sd relative to the running max keeps the
// entropy H = log s - sd / s free of the cancellation that sum p*z - logZ would suffer. The
// statistics are computed in the logits' own units (x) and scaled to z at the end, so the inner
// loop is: convert, subtract, exp2 (one MUFU op), add, fma.
//
// Backward: with the global logZ and E[z] of each token, grad-logits is elementwise, so one read of
// the logits and one write of the grads: grad = p * (-g_logp*inv_temp - g_ent*inv_temp*(z - Ez)),
// plus g_logp*inv_temp at the target; no fp32 copy of the logits anywhere.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "float_types.cuh"
#include "kernels.h"

namespace verl_mcore {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
// Differences below this are clamped so that -inf logits give exp = 0 and 0 * d = 0, not NaN.
constexpr float kMinDiff = -1e30f;
constexpr int kThreads = 256;
constexpr int kUnroll = 4;


// 16 bytes of T <-> floats.
template <typename T>
struct Vec16 {
  static constexpr int N = 16 / sizeof(T);
  __device__ __forceinline__ static void unpack(const uint4& u, float (&f)[N]) {
    const T* p = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = to_float<T>(p[i]);
  }
  __device__ __forceinline__ static uint4 pack(const float (&f)[N]) {
    uint4 u;
    T* p = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = from_float<T>(f[i]);
    return u;
  }
};

// bf16 -> f32 is a shift; spelling it out keeps the inner loop to one integer op per element.
template <>
__device__ __forceinline__ void Vec16<__nv_bfloat16>::unpack(const uint4& u, float (&f)[8]) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Online (max, sum exp, sum exp * diff) in the logits' units; k = inv_temp * log2(e).
struct OnlineStats {
  float m = -INFINITY, s = 0.f, sd = 0.f;

  __device__ __forceinline__ void rescale_to(float new_m, float k) {
    if (new_m > m) {
      if (m == -INFINITY) {
        s = 0.f;
        sd = 0.f;
      } else {
        const float delta = m - new_m;
        const float scale = exp2f(delta * k);
        sd = scale * fmaf(delta, s, sd);
        s *= scale;
      }
      m = new_m;
    }
  }
  __device__ __forceinline__ void add(float x, float k) {
    const float d = fmaxf(x - m, kMinDiff);
    const float e = exp2f(d * k);
    s += e;
    sd = fmaf(e, d, sd);
  }
  __device__ __forceinline__ void merge(const OnlineStats& o, float k) {
    if (o.m == -INFINITY) return;
    if (m == -INFINITY) { *this = o; return; }
    const float M = fmaxf(m, o.m);
    const float d1 = m - M, d2 = o.m - M;
    const float c1 = exp2f(d1 * k), c2 = exp2f(d2 * k);
    sd = c1 * fmaf(d1, s, sd) + c2 * fmaf(d2, o.s, o.sd);
    s = c1 * s + c2 * o.s;
    m = M;
  }
};

template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
lpe_forward_kernel(const T* __restrict__ logits, int64_t row_stride, const int64_t* __restrict__ target,
                   int64_t V, int64_t vocab_start, float inv_temp, float4* __restrict__ stats) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  const float k = inv_temp * kLog2e;
  OnlineStats st;

  if constexpr (VEC) {
    // Rows are 16-byte aligned and V is a multiple of the vector width (checked by the launcher).
    using Vec = Vec16<T>;
    constexpr int N = Vec::N;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const int64_t nvec = V / N;
    for (int64_t base = threadIdx.x; base < nvec; base += int64_t(kThreads) * kUnroll) {
      uint4 raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = base + int64_t(u) * kThreads;
        raw[u] = j < nvec ? __ldcs(xv + j) : make_uint4(0u, 0u, 0u, 0u);
      }
      float f[kUnroll][N];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) Vec::unpack(raw[u], f[u]);
      // Vectors past the row's end count as -inf (exp = 0).
      float gm = -INFINITY;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const bool in = base + int64_t(u) * kThreads < nvec;
#pragma unroll
        for (int i = 0; i < N; ++i) {
          if (!in) f[u][i] = -INFINITY;
          gm = fmaxf(gm, f[u][i]);
        }
      }
      st.rescale_to(gm, k);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int i = 0; i < N; ++i) st.add(f[u][i], k);
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += kThreads) {
      const float f = to_float<T>(x[j]);
      st.rescale_to(f, k);
      st.add(f, k);
    }
  }

  // Merge the threads' statistics: within each warp, then across warps.
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    OnlineStats o;
    o.m = __shfl_xor_sync(0xffffffffu, st.m, off);
    o.s = __shfl_xor_sync(0xffffffffu, st.s, off);
    o.sd = __shfl_xor_sync(0xffffffffu, st.sd, off);
    st.merge(o, k);
  }
  __shared__ float sm[kThreads / 32][3];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) { sm[warp][0] = st.m; sm[warp][1] = st.s; sm[warp][2] = st.sd; }
  __syncthreads();
  if (threadIdx.x == 0) {
    OnlineStats total;
    for (int w = 0; w < kThreads / 32; ++w) {
      OnlineStats o;
      o.m = sm[w][0]; o.s = sm[w][1]; o.sd = sm[w][2];
      total.merge(o, k);
    }
    const int64_t t = target[row] - vocab_start;
    const float zt = (t >= 0 && t < V) ? to_float<T>(x[t]) * inv_temp : 0.f;
    stats[row] = make_float4(total.m * inv_temp, total.s, total.sd * inv_temp, zt);
  }
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
lpe_backward_kernel(const T* __restrict__ logits, int64_t row_stride, const int64_t* __restrict__ target,
                    int64_t V, int64_t vocab_start, float inv_temp, const float* __restrict__ logZ,
                    const float* __restrict__ Ez, const float* __restrict__ g_logp, const float* __restrict__ g_ent,
                    T* __restrict__ grad, int64_t grad_row_stride) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  T* g = grad + row * grad_row_stride;
  const float k = inv_temp * kLog2e;
  const float lz2 = logZ[row] * kLog2e;
  const float ez = Ez[row];
  const float glp = g_logp[row] * inv_temp;
  const float gh = g_ent[row] * inv_temp;
  // grad(x) = p * (-glp - gh * (x*inv_temp - Ez)),  p = exp2(x*k - logZ*log2e)
  auto grad_of = [&](float xv) {
    const float p = exp2f(fmaf(xv, k, -lz2));
    return p * fmaf(-gh, fmaf(xv, inv_temp, -ez), -glp);
  };

  if constexpr (VEC) {
    using Vec = Vec16<T>;
    constexpr int N = Vec::N;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint4* gv = reinterpret_cast<uint4*>(g);
    const int64_t nvec = V / N;
    for (int64_t base = threadIdx.x; base < nvec; base += int64_t(kThreads) * kUnroll) {
      uint4 raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = base + int64_t(u) * kThreads;
        if (j < nvec) raw[u] = __ldcs(xv + j);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = base + int64_t(u) * kThreads;
        if (j < nvec) {
          float f[N];
          Vec::unpack(raw[u], f);
#pragma unroll
          for (int i = 0; i < N; ++i) f[i] = grad_of(f[i]);
          __stcs(gv + j, Vec::pack(f));
        }
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += kThreads) g[j] = from_float<T>(grad_of(to_float<T>(x[j])));
  }

  // The target's element gets +g_logp*inv_temp. Rewritten by one thread after the barrier (which
  // orders it after the bulk write of the same element), computed in fp32 to round once.
  const int64_t t = target[row] - vocab_start;
  if (t >= 0 && t < V) {
    __syncthreads();
    if (threadIdx.x == 0) g[t] = from_float<T>(grad_of(to_float<T>(x[t])) + glp);
  }
}

template <typename T>
bool vector_ok(const void* p, int64_t row_stride, int64_t V) {
  constexpr int N = 16 / sizeof(T);
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && row_stride % N == 0 && V % N == 0;
}

template <typename T>
cudaError_t forward_typed(const void* logits, int64_t row_stride, const int64_t* target, int64_t tokens, int64_t V,
                          int64_t vocab_start, float inv_temp, float* stats, cudaStream_t stream) {
  const T* x = static_cast<const T*>(logits);
  float4* st = reinterpret_cast<float4*>(stats);
  if (vector_ok<T>(logits, row_stride, V))
    lpe_forward_kernel<T, true><<<unsigned(tokens), kThreads, 0, stream>>>(x, row_stride, target, V, vocab_start, inv_temp, st);
  else
    lpe_forward_kernel<T, false><<<unsigned(tokens), kThreads, 0, stream>>>(x, row_stride, target, V, vocab_start, inv_temp, st);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward_typed(const void* logits, int64_t row_stride, const int64_t* target, int64_t tokens, int64_t V,
                           int64_t vocab_start, float inv_temp, const float* logZ, const float* Ez,
                           const float* g_logp, const float* g_ent, void* grad, int64_t grad_row_stride,
                           cudaStream_t stream) {
  const T* x = static_cast<const T*>(logits);
  T* g = static_cast<T*>(grad);
  if (vector_ok<T>(logits, row_stride, V) && vector_ok<T>(grad, grad_row_stride, V))
    lpe_backward_kernel<T, true><<<unsigned(tokens), kThreads, 0, stream>>>(
        x, row_stride, target, V, vocab_start, inv_temp, logZ, Ez, g_logp, g_ent, g, grad_row_stride);
  else
    lpe_backward_kernel<T, false><<<unsigned(tokens), kThreads, 0, stream>>>(
        x, row_stride, target, V, vocab_start, inv_temp, logZ, Ez, g_logp, g_ent, g, grad_row_stride);
  return cudaGetLastError();
}

}  // namespace

cudaError_t lpe_forward_launch(const void* logits, FloatDtype dtype, int64_t row_stride, const int64_t* target,
                               int64_t tokens, int64_t vocab_local, int64_t vocab_start, float inv_temp,
                               float* stats, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  switch (dtype) {
    case FloatDtype::kFloat32:
      return forward_typed<float>(logits, row_stride, target, tokens, vocab_local, vocab_start, inv_temp, stats, stream);
    case FloatDtype::kBFloat16:
      return forward_typed<__nv_bfloat16>(logits, row_stride, target, tokens, vocab_local, vocab_start, inv_temp, stats, stream);
    case FloatDtype::kFloat16:
      return forward_typed<__half>(logits, row_stride, target, tokens, vocab_local, vocab_start, inv_temp, stats, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t lpe_backward_launch(const void* logits, FloatDtype dtype, int64_t row_stride, const int64_t* target,
                                int64_t tokens, int64_t vocab_local, int64_t vocab_start, float inv_temp,
                                const float* logZ, const float* Ez, const float* g_logp, const float* g_ent,
                                void* grad_logits, int64_t grad_row_stride, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  switch (dtype) {
    case FloatDtype::kFloat32:
      return backward_typed<float>(logits, row_stride, target, tokens, vocab_local, vocab_start, inv_temp, logZ, Ez,
                                   g_logp, g_ent, grad_logits, grad_row_stride, stream);
    case FloatDtype::kBFloat16:
      return backward_typed<__nv_bfloat16>(logits, row_stride, target, tokens, vocab_local, vocab_start, inv_temp,
                                           logZ, Ez, g_logp, g_ent, grad_logits, grad_row_stride, stream);
    case FloatDtype::kFloat16:
      return backward_typed<__half>(logits, row_stride, target, tokens, vocab_local, vocab_start, inv_temp, logZ, Ez,
                                    g_logp, g_ent, grad_logits, grad_row_stride, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace verl_mcore
