// The native engine's sampler in one kernel (verl_mcore/rollout/sampling.py `sample_fused`).
//
// A decoding step draws one token per sequence from softmax(logits / T) over the whole vocabulary
// (no top-k / top-p), by inverting the CDF at the sequence's uniform u: the 256-entry block where
// the running mass crosses u * total, then the entry inside it (sampling.py `_invert_cdf_blocked`,
// whose torch form is a softmax, a padded copy, block sums, a cumsum and two searches: ~15 kernels
// that write and reread the [b, V] probabilities in float32). Here one CTA per row reads the row's
// logits twice (its max; then each block's sum of exp, kept in shared memory), scans the block
// sums, and rereads one block: about 2 x V x 2 bytes a row, and the chosen token's log-prob
// (log softmax(logits / T)[token], float32) comes from the same max and sum. Temperature 0 is the
// first index of the largest logit (torch's argmax) with its log-prob at T = 1.
//
// The sums are the same real numbers as the torch form's but summed in another order (and over
// exp(z - max) rather than the normalised probabilities), so a draw whose u falls within float
// rounding of a boundary between two entries can pick the neighbour; the distribution is the same.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "float_types.cuh"
#include "kernels.h"

namespace verl_mcore {
namespace {

constexpr int kSampleThreads = 512;
constexpr int kWarps = kSampleThreads / 32;
constexpr int kBlock = 256;  // entries of a CDF block: a warp's 32 lanes x 8
// Block sums in dynamic shared memory, under the 48 KB a launch gets without opting in (with the
// kernel's ~300 B of static shared memory): vocabularies up to 3,072,000 entries.
constexpr int64_t kMaxBlocks = 12000;

template <typename T> __device__ __forceinline__ float load(const T* row, int64_t i, int64_t vocab) {
  return i < vocab ? to_float<T>(row[i]) : -INFINITY;
}

// The 8 entries lane `lane` holds of block `j`: row[j * 256 + lane * 8 + k] (-inf past vocab).
template <typename T>
__device__ __forceinline__ void load8(const T* row, int64_t vocab, int64_t j, int lane, bool vec, float (&x)[8]) {
  const int64_t base = j * kBlock + lane * 8;
  if (vec && base + 8 <= vocab) {  // 16-byte loads: one for bf16/fp16, two for fp32
    alignas(16) T v[8];
#pragma unroll
    for (int k = 0; k < 8; k += 16 / int(sizeof(T)))
      *reinterpret_cast<uint4*>(v + k) = *reinterpret_cast<const uint4*>(row + base + k);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = to_float<T>(v[k]);
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) x[k] = load(row, base + k, vocab);
}

// Blocks a warp loads before using any (bytes in flight: a warp's 512 B per block is too few to
// stream a row at the SM's share of the bandwidth).
constexpr int kUnroll = 4;

// The 8 x kUnroll entries lane `lane` holds of blocks j0, j0 + kWarps, ... (-inf past the row).
template <typename T>
__device__ __forceinline__ void load_blocks(const T* row, int64_t vocab, int64_t nblocks, int64_t j0, int lane,
                                            bool vec, float (&x)[kUnroll][8]) {
#pragma unroll
  for (int t = 0; t < kUnroll; ++t) {
    const int64_t j = j0 + int64_t(t) * kWarps;
    if (j < nblocks) {
      load8(row, vocab, j, lane, vec, x[t]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) x[t][k] = -INFINITY;
    }
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// (value, index) of the larger value; on equal values the smaller index; NaN above everything
// (torch's argmax: the first NaN, else the first maximum).
__device__ __forceinline__ void max_with_index(float& v, int64_t& i, float ov, int64_t oi) {
  const bool o_nan = isnan(ov), nan = isnan(v);
  if (o_nan ? (!nan || oi < i) : (!nan && (ov > v || (ov == v && oi < i)))) {
    v = ov;
    i = oi;
  }
}

// One CTA per row. Dynamic shared memory: the row's block sums, float[nblocks].
template <typename T>
__global__ void __launch_bounds__(kSampleThreads)
sample_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t vocab, float inv_temp, bool greedy,
              const double* __restrict__ u, int64_t* __restrict__ tokens, float* __restrict__ logp, bool vec) {
  extern __shared__ float block_sum[];
  __shared__ float red_v[kWarps];
  __shared__ int64_t red_i[kWarps];
  __shared__ float red_s[kWarps];
  __shared__ float s_max, s_total;
  __shared__ int64_t s_arg;
  __shared__ int s_j;
  const T* row = logits + blockIdx.x * row_stride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t nblocks = (vocab + kBlock - 1) / kBlock;

  // 1. the row's max (and its first index)
  float m = -INFINITY;
  int64_t arg = 0;
  for (int64_t j0 = warp; j0 < nblocks; j0 += int64_t(kWarps) * kUnroll) {
    float x[kUnroll][8];
    load_blocks(row, vocab, nblocks, j0, lane, vec, x);
#pragma unroll
    for (int t = 0; t < kUnroll; ++t)
#pragma unroll
      for (int k = 0; k < 8; ++k) max_with_index(m, arg, x[t][k], (j0 + int64_t(t) * kWarps) * kBlock + lane * 8 + k);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, m, off);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, arg, off);
    max_with_index(m, arg, ov, oi);
  }
  if (lane == 0) {
    red_v[warp] = m;
    red_i[warp] = arg;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = red_v[0];
    int64_t bi = red_i[0];
    for (int w = 1; w < kWarps; ++w) max_with_index(bm, bi, red_v[w], red_i[w]);
    s_max = bm;
    s_arg = bi;
  }
  __syncthreads();
  m = s_max;
  const float scale = greedy ? 1.f : inv_temp;  // greedy log-probs are at T = 1

  // 2. each block's sum of exp((x - max) / T)
  float total = 0.f;
  for (int64_t j0 = warp; j0 < nblocks; j0 += int64_t(kWarps) * kUnroll) {
    float x[kUnroll][8];
    load_blocks(row, vocab, nblocks, j0, lane, vec, x);
#pragma unroll
    for (int t = 0; t < kUnroll; ++t) {
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) s += __expf((x[t][k] - m) * scale);  // exp(-inf) = 0 past the row
      s = warp_sum(s);
      const int64_t j = j0 + int64_t(t) * kWarps;
      if (lane == 0 && j < nblocks) block_sum[j] = s;
      total += s;
    }
  }
  if (lane == 0) red_s[warp] = total;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.f;
    for (int w = 0; w < kWarps; ++w) t += red_s[w];
    s_total = t;
  }
  __syncthreads();

  // A row without finite mass (a NaN or +inf logit, all -inf, 1/T overflowing) has no
  // distribution to draw from: it gets its argmax, as greedy does.
  const bool degenerate = !isfinite(m) || !(s_total > 0.f) || !isfinite(s_total);
  if (!greedy && !degenerate) {
    // 3. the block where the running mass crosses u * total. Warp 0: each lane sums a contiguous
    //    chunk of the block sums, a scan over the lanes, then the crossing lane walks its chunk.
    if (warp == 0) {
      const int64_t per = (nblocks + 31) / 32;
      const int64_t lo = min(nblocks, lane * per), hi = min(nblocks, lo + per);
      float chunk = 0.f;
      for (int64_t j = lo; j < hi; ++j) chunk += block_sum[j];
      float incl = chunk;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float o = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += o;
      }
      const float run = __shfl_sync(0xffffffffu, incl, 31);
      // Where u * total rounds up to the total, the last entry that adds mass (torch's fallback).
      const float target = fminf(float(u[blockIdx.x] * double(run)), nextafterf(run, 0.f));
      // Only a lane whose chunk has mass may cross (the lanes' sums, grouped differently, can
      // round an ulp above a preceding lane's where a chunk is empty); failing that, the last
      // lane with mass. `run` > 0, so some lane has.
      const unsigned has = __ballot_sync(0xffffffffu, chunk > 0.f);
      const unsigned crossing = __ballot_sync(0xffffffffu, chunk > 0.f && incl > target);
      if (lane == (crossing ? __ffs(crossing) - 1 : 31 - __clz(has))) {
        float acc = incl - chunk, before = acc;
        int64_t pick = -1;
        for (int64_t j = lo; j < hi; ++j) {
          if (block_sum[j] > 0.f) {  // never a block without mass
            pick = j;
            before = acc;
            if (acc + block_sum[j] > target) break;
          }
          acc += block_sum[j];
        }
        s_j = int(pick);  // the chunk holds mass, so pick >= 0
        red_v[0] = target - before;
      }
    }
    __syncthreads();
    // 4. the entry inside block s_j: warp 0 scans its 256 entries
    if (warp == 0) {
      const int64_t j = s_j;
      float x[8], e[8];
      load8(row, vocab, j, lane, vec, x);
      float own = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        e[k] = __expf((x[k] - m) * scale);
        own += e[k];
      }
      float incl = own;  // inclusive prefix of the lanes' sums
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float o = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += o;
      }
      const float final_sum = __shfl_sync(0xffffffffu, incl, 31);
      const float target = fminf(red_v[0], nextafterf(final_sum, 0.f));
      float run = incl - own;
      // the first entry with mass past the target; failing that (rounding), the first with mass
      // where the sum reaches its end; failing that, the last with mass
      int first = kBlock, full = kBlock, last_nz = -1;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        run += e[k];
        const int idx = lane * 8 + k;
        if (e[k] > 0.f) {
          if (run > target && first == kBlock) first = idx;
          if (run >= final_sum && full == kBlock) full = idx;
          last_nz = idx;
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        first = min(first, __shfl_xor_sync(0xffffffffu, first, off));
        full = min(full, __shfl_xor_sync(0xffffffffu, full, off));
        last_nz = max(last_nz, __shfl_xor_sync(0xffffffffu, last_nz, off));
      }
      if (lane == 0) s_arg = j * kBlock + (first < kBlock ? first : full < kBlock ? full : max(last_nz, 0));
    }
    __syncthreads();
  }
  const int64_t token = s_arg;
  if (threadIdx.x == 0) {
    tokens[blockIdx.x] = token;
    // degenerate rows: NaN or +-inf, as torch's log_softmax gives them
    if (logp) logp[blockIdx.x] = (to_float<T>(row[token]) - m) * scale - logf(s_total);
  }
}

template <typename T>
cudaError_t sample_typed(const void* logits, int64_t rows, int64_t row_stride, int64_t vocab, float inv_temp,
                         bool greedy, const double* u, int64_t* tokens, float* logp, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t nblocks = (vocab + kBlock - 1) / kBlock;
  if (nblocks > kMaxBlocks || rows > 0x7fffffff) return cudaErrorInvalidValue;
  const size_t smem = size_t(nblocks) * sizeof(float);
  const bool vec = row_stride % 8 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  sample_kernel<T><<<unsigned(rows), kSampleThreads, smem, stream>>>(
      static_cast<const T*>(logits), row_stride, vocab, inv_temp, greedy, u, tokens, logp, vec);
  return cudaGetLastError();
}

}  // namespace

cudaError_t sample_launch(const void* logits, FloatDtype dtype, int64_t rows, int64_t row_stride, int64_t vocab,
                          float inv_temp, bool greedy, const double* u, int64_t* tokens, float* logp,
                          cudaStream_t stream) {
  switch (dtype) {
    case FloatDtype::kFloat32:
      return sample_typed<float>(logits, rows, row_stride, vocab, inv_temp, greedy, u, tokens, logp, stream);
    case FloatDtype::kBFloat16:
      return sample_typed<__nv_bfloat16>(logits, rows, row_stride, vocab, inv_temp, greedy, u, tokens, logp, stream);
    case FloatDtype::kFloat16:
      return sample_typed<__half>(logits, rows, row_stride, vocab, inv_temp, greedy, u, tokens, logp, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace verl_mcore
