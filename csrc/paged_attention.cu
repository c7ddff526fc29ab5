// Decode attention over the native engine's paged KV cache (verl_mcore/ops/decode.py
// `paged_attention`, flash="kernel"), for torch builds whose flash kernel takes no block table.
//
// One query token per sequence; decode attention is bandwidth-bound, so the design streams each
// sequence's keys and values once:
//
//   * one CTA per (sequence, KV group, up to kMaxHeads query heads of the group, split). It loads
//     its query heads once and reads each key/value row of its range once for all of them (the GQA
//     saving: a group of r heads costs one pass over its rows, not r);
//   * a row is read by TPR lanes (a "row group"), each loading 8 contiguous elements of its key
//     and of its value (one 16-byte load each, bf16/fp16) and taking the same 8 elements of each
//     query head from shared memory; the dot product is reduced across the row group with
//     butterfly shuffles, so every lane of it holds the score;
//   * the CTA's row groups take the rows of its range in turn, kRowsPerThread rows each per
//     iteration (that many loads in flight per lane), with an online softmax per head in fp32
//     (running max and sum; scores in the log2 domain, q pre-scaled by scale * log2(e));
//   * row groups combine by shuffles inside a warp, warps through shared memory;
//   * split-K (flash-decoding): with `splits` > 1 the CTA of split s takes the s-th of `splits`
//     equal shares of its sequence's keys and writes (max, sum, unnormalised acc) to a workspace;
//     a second kernel combines the splits of each head (log-sum-exp). A split whose share starts
//     past the sequence's length writes sum = 0, which the combine skips.
//
// Cost per key row and head: 8 FMAs for the score and 8 for the value in each lane, and a
// log2(TPR)-step shuffle reduction: about r fp32 FLOP per byte of bf16 K/V. Groups of up to ~4
// heads should stream at the copy bandwidth; r = 7 or 8 comes near the SMs' fp32 issue rate
// (tensor-core MMAs would be the next step there). Groups of more than kMaxHeads heads take one
// CTA per 8 heads, each reading the rows again. Not yet timed on a GPU.
//
// The launch depends on shapes only (grid: batch x groups x head chunks by splits; the shares
// come from seq_lens on the device), so one CUDA graph serves every mix of lengths.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "float_types.cuh"
#include "kernels.h"

namespace verl_mcore {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerThread = 4;  // rows a row group reads per iteration (loads in flight)
constexpr int kMaxHeads = 8;       // query heads a CTA serves (registers: 8 acc + 4 scores a head and lane)
constexpr int kCombineThreads = 128;
// The running max before any key: finite, so that max - max is 0, never inf - inf.
constexpr float kNoScore = -1e30f;
constexpr float kLog2e = 1.4426950408889634f;

// 8 contiguous elements at p (16-byte aligned) as floats.
template <typename T> __device__ __forceinline__ void load8(const T* p, float (&x)[8]);

template <> __device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16* p, float (&x)[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // a bf16 is the high half of a float: exact by shifting
    x[2 * i] = __uint_as_float(w[i] << 16);
    x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

template <> __device__ __forceinline__ void load8<__half>(const __half* p, float (&x)[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
    x[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
  }
}

struct Shape {
  int heads, groups, r, chunks;  // chunks: CTAs per group, each serving up to kMaxHeads heads
  int hd, block_size, block_shift, width, splits;  // block_shift: log2(block_size), or -1
  float qscale;                                    // softmax scale * log2(e)
};

// The TPR lanes of a row group read a row's 8 * TPR elements (lanes past hd / 8 idle); R is the
// number of heads a CTA serves (the last chunk of a group may serve fewer: `nr`).
//
// Shared memory: the query heads [R, hd]; per warp and head its acc [hd]; per warp and head max
// and sum.
template <typename T, int TPR, int R>
__global__ void __launch_bounds__(kThreads)
paged_attention_kernel(const T* __restrict__ q, const T* __restrict__ cache_k, const T* __restrict__ cache_v,
                       const int* __restrict__ block_table, const int* __restrict__ seq_lens, T* __restrict__ out,
                       float* __restrict__ part_acc, float* __restrict__ part_ml, Shape s) {
  constexpr int kGroupsPerWarp = 32 / TPR;
  constexpr int kRowGroups = kWarps * kGroupsPerWarp;
  constexpr int kStep = kRowGroups * kRowsPerThread;  // rows a CTA reads per iteration
  const int chunk = blockIdx.x % s.chunks;
  const int g = (blockIdx.x / s.chunks) % s.groups;
  const int64_t seq = blockIdx.x / (int64_t(s.chunks) * s.groups);
  const int split = blockIdx.y;
  const int64_t head0 = seq * s.heads + int64_t(g) * s.r + chunk * R;  // first of this CTA's heads
  const int nr = min(R, s.r - chunk * R);
  // Keys 0..len-1 (lengths past the table are clamped to it, as the reference's mask does).
  const int len = min(max(__ldg(seq_lens + seq), 0), s.width * s.block_size);
  // Split `split` takes keys [start, end): equal shares in whole iterations.
  const int share = ((len + s.splits - 1) / s.splits + kStep - 1) / kStep * kStep;
  const int start = split * share;
  const int end = min(len, start + share);
  if (start >= end) {  // CTA-uniform: nothing of this sequence here
    if (s.splits > 1) {
      if (int(threadIdx.x) < nr) {
        part_ml[((head0 + threadIdx.x) * s.splits + split) * 2] = kNoScore;
        part_ml[((head0 + threadIdx.x) * s.splits + split) * 2 + 1] = 0.f;  // the combine skips it
      }
    } else {
      for (int i = threadIdx.x; i < nr * s.hd; i += kThreads) out[head0 * s.hd + i] = from_float<T>(0.f);  // len 0
    }
    return;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane % TPR;                             // this lane's 8 elements of a row
  const int rg = warp * kGroupsPerWarp + lane / TPR;      // this lane's row group
  const bool active = sub * 8 < s.hd;

  // The CTA's query heads, pre-scaled, in shared memory (zeros for heads past nr): each lane reads
  // a head's 8 elements once per iteration, for all its rows.
  extern __shared__ float4 smem4[];
  float* s_q = reinterpret_cast<float*>(smem4);  // [R, hd]
  for (int i = threadIdx.x; i < R * s.hd; i += kThreads) {
    s_q[i] = i < nr * s.hd ? to_float<T>(q[head0 * s.hd + i]) * s.qscale : 0.f;
  }
  __syncthreads();
  float m[R], l[R], acc[R][8];
#pragma unroll
  for (int h = 0; h < R; ++h) {
    m[h] = kNoScore;
    l[h] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[h][j] = 0.f;
  }

  // cache [blocks, block_size, groups, hd]: row p of the sequence is block table[p / block_size],
  // row p % block_size; this lane reads elements g * hd + sub * 8 .. + 8 of it.
  const int64_t row_stride = int64_t(s.groups) * s.hd;
  const T* k_base = cache_k + g * s.hd + sub * 8;
  const T* v_base = cache_v + g * s.hd + sub * 8;
  const int* table = block_table + seq * s.width;

  // The trip count is CTA-uniform (every lane reaches every shuffle); rows past `end` are masked.
  for (int base = start; base < end; base += kStep) {
    float kf[kRowsPerThread][8], vf[kRowsPerThread][8];
    bool valid[kRowsPerThread];
#pragma unroll
    for (int u = 0; u < kRowsPerThread; ++u) {
      const int p = base + u * kRowGroups + rg;
      valid[u] = p < end;  // the same for every lane of the row group
      if (valid[u] && active) {
        const int b = s.block_shift >= 0 ? p >> s.block_shift : p / s.block_size;
        const int64_t row = int64_t(__ldg(table + b)) * s.block_size + (p - b * s.block_size);
        load8<T>(k_base + row * row_stride, kf[u]);
        load8<T>(v_base + row * row_stride, vf[u]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) kf[u][j] = vf[u][j] = 0.f;
      }
    }
    float sc[kRowsPerThread][R];  // scores, log2 domain
#pragma unroll
    for (int h = 0; h < R; ++h) {
      float qh[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // idle lanes add 0 to the score
      if (active) {
        const float4 a = *reinterpret_cast<const float4*>(s_q + h * s.hd + sub * 8);
        const float4 b = *reinterpret_cast<const float4*>(s_q + h * s.hd + sub * 8 + 4);
        qh[0] = a.x, qh[1] = a.y, qh[2] = a.z, qh[3] = a.w, qh[4] = b.x, qh[5] = b.y, qh[6] = b.z, qh[7] = b.w;
      }
#pragma unroll
      for (int u = 0; u < kRowsPerThread; ++u) {
        float d = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) d = fmaf(qh[j], kf[u][j], d);
        sc[u][h] = d;
      }
    }
#pragma unroll
    for (int off = TPR / 2; off > 0; off >>= 1) {
#pragma unroll
      for (int u = 0; u < kRowsPerThread; ++u) {
#pragma unroll
        for (int h = 0; h < R; ++h) sc[u][h] += __shfl_xor_sync(0xffffffffu, sc[u][h], off);
      }
    }
#pragma unroll
    for (int h = 0; h < R; ++h) {
      float mx = m[h];
#pragma unroll
      for (int u = 0; u < kRowsPerThread; ++u) mx = valid[u] ? fmaxf(mx, sc[u][h]) : mx;
      const float corr = exp2f(m[h] - mx);
      m[h] = mx;
      l[h] *= corr;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[h][j] *= corr;
#pragma unroll
      for (int u = 0; u < kRowsPerThread; ++u) {
        const float p = valid[u] ? exp2f(sc[u][h] - mx) : 0.f;
        l[h] += p;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[h][j] = fmaf(p, vf[u][j], acc[h][j]);
      }
    }
  }

  // Row groups of a warp: merge (max, sum, acc) pairwise; every lane ends with the warp's totals.
#pragma unroll
  for (int off = TPR; off < 32; off <<= 1) {
#pragma unroll
    for (int h = 0; h < R; ++h) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[h], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[h], off);
      const float mx = fmaxf(m[h], mo);
      const float a = exp2f(m[h] - mx), b = exp2f(mo - mx);
      l[h] = l[h] * a + lo * b;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[h][j] = acc[h][j] * a + __shfl_xor_sync(0xffffffffu, acc[h][j], off) * b;
      m[h] = mx;
    }
  }

  // Warps: through shared memory; then each thread finishes elements (head, d) of the output.
  float* s_acc = s_q + R * s.hd;                // [kWarps, R, hd]
  float* s_m = s_acc + kWarps * R * s.hd;       // [kWarps, R]
  float* s_l = s_m + kWarps * R;                // [kWarps, R]
  if (lane < TPR && active) {
#pragma unroll
    for (int h = 0; h < R; ++h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) s_acc[(warp * R + h) * s.hd + sub * 8 + j] = acc[h][j];
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < R; ++h) {
      s_m[warp * R + h] = m[h];
      s_l[warp * R + h] = l[h];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nr * s.hd; i += kThreads) {
    const int h = i / s.hd, d = i % s.hd;
    float mx = kNoScore;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w * R + h]);
    float sum = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = exp2f(s_m[w * R + h] - mx);  // 0 for a warp that read no row
      sum = fmaf(s_l[w * R + h], f, sum);
      a = fmaf(s_acc[(w * R + h) * s.hd + d], f, a);
    }
    const int64_t head = head0 + h;
    if (s.splits == 1) {
      out[head * s.hd + d] = from_float<T>(a / sum);  // sum >= 1: the range holds a key
    } else {
      part_acc[(head * s.splits + split) * s.hd + d] = a;
      if (d == 0) {
        part_ml[(head * s.splits + split) * 2] = mx;
        part_ml[(head * s.splits + split) * 2 + 1] = sum;
      }
    }
  }
}

// One CTA per (sequence, head): out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M) over the
// splits that read a key (l_s > 0; the others' acc was never written).
template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
paged_attention_combine_kernel(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                               T* __restrict__ out, int hd, int splits) {
  const int64_t head = blockIdx.x;
  const float* ml = part_ml + head * splits * 2;
  float mx = kNoScore;
  for (int i = 0; i < splits; ++i) mx = ml[2 * i + 1] > 0.f ? fmaxf(mx, ml[2 * i]) : mx;
  float sum = 0.f;
  for (int i = 0; i < splits; ++i) sum += ml[2 * i + 1] > 0.f ? ml[2 * i + 1] * exp2f(ml[2 * i] - mx) : 0.f;
  for (int d = threadIdx.x; d < hd; d += kCombineThreads) {
    float a = 0.f;
    for (int i = 0; i < splits; ++i) {
      if (ml[2 * i + 1] > 0.f) a = fmaf(part_acc[(head * splits + i) * hd + d], exp2f(ml[2 * i] - mx), a);
    }
    out[head * hd + d] = from_float<T>(sum > 0.f ? a / sum : 0.f);  // sum 0: a sequence of length 0
  }
}

template <typename T, int TPR, int R>
cudaError_t launch_heads(const T* q, const T* cache_k, const T* cache_v, const int* block_table,
                         const int* seq_lens, T* out, float* part_acc, float* part_ml, int64_t batch, const Shape& s,
                         cudaStream_t stream) {
  const dim3 grid(unsigned(batch * s.groups * s.chunks), unsigned(s.splits));
  const size_t smem = sizeof(float) * (R * s.hd + kWarps * R * (s.hd + 2));
  paged_attention_kernel<T, TPR, R><<<grid, kThreads, smem, stream>>>(q, cache_k, cache_v, block_table, seq_lens,
                                                                      out, part_acc, part_ml, s);
  return cudaGetLastError();
}

template <typename T, int TPR>
cudaError_t launch_tpr(const T* q, const T* cache_k, const T* cache_v, const int* block_table, const int* seq_lens,
                       T* out, float* part_acc, float* part_ml, int64_t batch, const Shape& s, int heads_per_cta,
                       cudaStream_t stream) {
#define VERL_MCORE_HEADS(R) \
  case R: return launch_heads<T, TPR, R>(q, cache_k, cache_v, block_table, seq_lens, out, part_acc, part_ml, batch, s, stream)
  switch (heads_per_cta) {
    VERL_MCORE_HEADS(1);
    VERL_MCORE_HEADS(2);
    VERL_MCORE_HEADS(3);
    VERL_MCORE_HEADS(4);
    VERL_MCORE_HEADS(5);
    VERL_MCORE_HEADS(6);
    VERL_MCORE_HEADS(7);
    VERL_MCORE_HEADS(8);
  }
#undef VERL_MCORE_HEADS
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t paged_attention_typed(const void* q, const void* cache_k, const void* cache_v, const int32_t* block_table,
                                  const int32_t* seq_lens, void* out, float* part_acc, float* part_ml, int64_t batch,
                                  int heads, int groups, int hd, int block_size, int width, int splits, float scale,
                                  cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  const int r = heads / groups;
  const int heads_per_cta = r < kMaxHeads ? r : kMaxHeads;
  int shift = -1;
  if ((block_size & (block_size - 1)) == 0) {
    shift = 0;
    while ((1 << shift) < block_size) ++shift;
  }
  const Shape s{heads, groups, r, (r + kMaxHeads - 1) / kMaxHeads, hd, block_size, shift, width, splits,
                scale * kLog2e};
  const T* qt = static_cast<const T*>(q);
  const T* kt = static_cast<const T*>(cache_k);
  const T* vt = static_cast<const T*>(cache_v);
  T* ot = static_cast<T*>(out);
  // Lanes a row (8 elements each): the fewest of 8, 16, 32 that cover hd.
  cudaError_t err;
  if (hd <= 64) {
    err = launch_tpr<T, 8>(qt, kt, vt, block_table, seq_lens, ot, part_acc, part_ml, batch, s, heads_per_cta, stream);
  } else if (hd <= 128) {
    err = launch_tpr<T, 16>(qt, kt, vt, block_table, seq_lens, ot, part_acc, part_ml, batch, s, heads_per_cta, stream);
  } else {
    err = launch_tpr<T, 32>(qt, kt, vt, block_table, seq_lens, ot, part_acc, part_ml, batch, s, heads_per_cta, stream);
  }
  if (err != cudaSuccess || splits == 1) return err;
  paged_attention_combine_kernel<T><<<unsigned(batch * heads), kCombineThreads, 0, stream>>>(part_acc, part_ml, ot,
                                                                                             hd, splits);
  return cudaGetLastError();
}

}  // namespace

cudaError_t paged_attention_launch(const void* q, const void* cache_k, const void* cache_v,
                                   const int32_t* block_table, const int32_t* seq_lens, void* out, float* part_acc,
                                   float* part_ml, FloatDtype dtype, int64_t batch, int heads, int groups, int hd,
                                   int block_size, int width, int splits, float scale, cudaStream_t stream) {
  switch (dtype) {
    case FloatDtype::kFloat32: break;  // not instantiated: the engine's fp32 models use the reference
    case FloatDtype::kBFloat16:
      return paged_attention_typed<__nv_bfloat16>(q, cache_k, cache_v, block_table, seq_lens, out, part_acc, part_ml,
                                                  batch, heads, groups, hd, block_size, width, splits, scale, stream);
    case FloatDtype::kFloat16:
      return paged_attention_typed<__half>(q, cache_k, cache_v, block_table, seq_lens, out, part_acc, part_ml, batch,
                                           heads, groups, hd, block_size, width, splits, scale, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace verl_mcore
