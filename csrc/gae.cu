// Batched GAE as a chunked affine scan with decoupled look-back.
//
// Reading the recurrence right to left, the state entering position t is (A, V): the advantage and
// the value of the next valid position (0, 0 past the end). A valid position maps it to
//   (A, V) -> (c*A + gamma*V + (r_t - v_t), v_t)          with c = gamma * lam
// and a masked position leaves it unchanged. Both are affine maps of (A, V), and affine maps
// compose, so a row can be scanned in parallel: each thread composes the maps of its ITEMS
// positions, the block composes the threads' maps (a suffix scan, since the recurrence runs right
// to left), and a tile of a long row learns the state entering it from the tiles to its right by
// decoupled look-back (each tile publishes its composed map early and its outgoing state when it
// knows it). Tiles take their index from an atomic counter in launch order, so every tile a block
// waits for has already been handed to a running block: no deadlock, one pass over the data.
#include <cuda_runtime.h>

#include "kernels.h"

namespace verl_mcore {
namespace {

// State (A, V) -> (a*A + b*V + d, e*V + f).
struct Affine {
  float a, b, d, e, f;
};

__device__ __forceinline__ Affine affine_identity() { return {1.f, 0.f, 0.f, 1.f, 0.f}; }

// outer ∘ inner: apply `inner` first (it lies to the right), then `outer`.
__device__ __forceinline__ Affine compose(const Affine& outer, const Affine& inner) {
  Affine o;
  o.a = outer.a * inner.a;
  o.b = fmaf(outer.a, inner.b, outer.b * inner.e);
  o.d = fmaf(outer.a, inner.d, fmaf(outer.b, inner.f, outer.d));
  o.e = outer.e * inner.e;
  o.f = fmaf(outer.e, inner.f, outer.f);
  return o;
}

__device__ __forceinline__ void apply(const Affine& m, float& A, float& V) {
  const float a = fmaf(m.a, A, fmaf(m.b, V, m.d));
  V = fmaf(m.e, V, m.f);
  A = a;
}

__device__ __forceinline__ Affine shfl_down(const Affine& m, int offset) {
  return {__shfl_down_sync(0xffffffffu, m.a, offset), __shfl_down_sync(0xffffffffu, m.b, offset),
          __shfl_down_sync(0xffffffffu, m.d, offset), __shfl_down_sync(0xffffffffu, m.e, offset),
          __shfl_down_sync(0xffffffffu, m.f, offset)};
}

// Look-back record of one tile. flag: 0 nothing yet, 1 `map` (the tile's composed map) is
// published, 2 the outgoing state (A, V) is published.
struct TileStatus {
  int flag;
  float a, b, d, e, f;
  float A, V;
};

constexpr int kFlagMap = 1;
constexpr int kFlagState = 2;

template <typename MaskT>
__device__ __forceinline__ bool is_valid(MaskT m) { return m != MaskT(0); }

// Merge the moments (n, mean, M2) of b into a.
__device__ __forceinline__ void merge_moments(float& n, float& mean, float& m2, float nb, float meanb, float m2b) {
  const float total = n + nb;
  if (total == 0.f) return;
  const float delta = meanb - mean;
  const float frac = nb / total;
  mean = fmaf(delta, frac, mean);
  m2 = m2 + m2b + delta * delta * n * frac;
  n = total;
}

// Loads ITEMS consecutive positions starting at `pos` of a row; positions >= hi are masked.
template <int ITEMS, typename MaskT, bool VEC>
__device__ __forceinline__ void load_items(const float* __restrict__ r_row, const float* __restrict__ v_row,
                                           const MaskT* __restrict__ m_row, int64_t pos, int64_t hi,
                                           float (&r)[ITEMS], float (&v)[ITEMS], bool (&valid)[ITEMS]) {
  if constexpr (VEC) {
    // T % 4 == 0, so a group of 4 is either entirely inside the row or entirely outside.
#pragma unroll
    for (int g = 0; g < ITEMS / 4; ++g) {
      const int64_t p = pos + 4 * g;
      if (p < hi) {
        const float4 r4 = *reinterpret_cast<const float4*>(r_row + p);
        const float4 v4 = *reinterpret_cast<const float4*>(v_row + p);
        r[4 * g] = r4.x; r[4 * g + 1] = r4.y; r[4 * g + 2] = r4.z; r[4 * g + 3] = r4.w;
        v[4 * g] = v4.x; v[4 * g + 1] = v4.y; v[4 * g + 2] = v4.z; v[4 * g + 3] = v4.w;
        if constexpr (sizeof(MaskT) == 1) {
          const uchar4 m4 = *reinterpret_cast<const uchar4*>(m_row + p);
          valid[4 * g] = m4.x; valid[4 * g + 1] = m4.y; valid[4 * g + 2] = m4.z; valid[4 * g + 3] = m4.w;
        } else {
          const float4 m4 = *reinterpret_cast<const float4*>(m_row + p);
          valid[4 * g] = m4.x != 0.f; valid[4 * g + 1] = m4.y != 0.f;
          valid[4 * g + 2] = m4.z != 0.f; valid[4 * g + 3] = m4.w != 0.f;
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) { r[4 * g + j] = 0.f; v[4 * g + j] = 0.f; valid[4 * g + j] = false; }
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int64_t p = pos + i;
      if (p < hi) {
        r[i] = r_row[p];
        v[i] = v_row[p];
        valid[i] = is_valid(m_row[p]);
      } else {
        r[i] = 0.f; v[i] = 0.f; valid[i] = false;
      }
    }
  }
}

template <int ITEMS, bool VEC>
__device__ __forceinline__ void store_items(float* __restrict__ adv_row, float* __restrict__ ret_row, int64_t pos,
                                            int64_t hi, const float (&adv)[ITEMS], const float (&ret)[ITEMS]) {
  if constexpr (VEC) {
#pragma unroll
    for (int g = 0; g < ITEMS / 4; ++g) {
      const int64_t p = pos + 4 * g;
      if (p < hi) {
        *reinterpret_cast<float4*>(adv_row + p) = make_float4(adv[4 * g], adv[4 * g + 1], adv[4 * g + 2], adv[4 * g + 3]);
        *reinterpret_cast<float4*>(ret_row + p) = make_float4(ret[4 * g], ret[4 * g + 1], ret[4 * g + 2], ret[4 * g + 3]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (pos + i < hi) { adv_row[pos + i] = adv[i]; ret_row[pos + i] = ret[i]; }
    }
  }
}

// One block scans one tile of TILE = WARPS*32*ITEMS positions of one row. Tiles of a row are
// aligned from the left (tile k covers [k*TILE, (k+1)*TILE)) so vector accesses stay aligned,
// and are handed out right to left. `tiles_per_row` == 1 needs no look-back and no workspace.
template <int WARPS, int ITEMS, typename MaskT, bool VEC>
__global__ void __launch_bounds__(WARPS * 32)
gae_kernel(const float* __restrict__ rewards, const float* __restrict__ values, const MaskT* __restrict__ mask,
           float* __restrict__ advantages, float* __restrict__ returns, int64_t T, int64_t tiles_per_row,
           float gamma, float c, TileStatus* status, unsigned int* tile_counter, float* __restrict__ tile_stats) {
  constexpr int THREADS = WARPS * 32;
  constexpr int64_t TILE = int64_t(THREADS) * ITEMS;
  __shared__ Affine warp_maps[WARPS];
  __shared__ float carry[2];
  __shared__ unsigned int tile_shared;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int64_t tile;
  if (tiles_per_row == 1) {
    tile = blockIdx.x;
  } else {
    if (tid == 0) tile_shared = atomicAdd(tile_counter, 1u);
    __syncthreads();
    tile = tile_shared;
  }
  const int64_t row = tile / tiles_per_row;
  const int64_t from_right = tile % tiles_per_row;  // 0: the row's last tile, scanned first
  const int64_t k = tiles_per_row - 1 - from_right;
  const int64_t lo = k * TILE;
  const int64_t hi = min(T, lo + TILE);
  const int64_t pos = lo + int64_t(tid) * ITEMS;

  const float* r_row = rewards + row * T;
  const float* v_row = values + row * T;
  const MaskT* m_row = mask + row * T;

  float r[ITEMS], v[ITEMS];
  bool valid[ITEMS];
  load_items<ITEMS, MaskT, VEC>(r_row, v_row, m_row, pos, hi, r, v, valid);

  // This thread's map: its positions composed right to left (a valid position is the map
  // (c, gamma, r - v, 0, v); composing it on the left of M needs no general product).
  Affine m = affine_identity();
#pragma unroll
  for (int i = ITEMS - 1; i >= 0; --i) {
    if (valid[i]) {
      m.a = c * m.a;
      m.b = fmaf(c, m.b, gamma * m.e);
      m.d = fmaf(c, m.d, fmaf(gamma, m.f, r[i] - v[i]));
      m.e = 0.f;
      m.f = v[i];
    }
  }

  // Suffix scan within the warp: incl = m_lane ∘ m_{lane+1} ∘ ... ∘ m_31.
  Affine incl = m;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const Affine other = shfl_down(incl, off);
    if (lane + off < 32) incl = compose(incl, other);
  }
  Affine lane_excl = shfl_down(incl, 1);  // maps of the lanes to this one's right
  if (lane == 31) lane_excl = affine_identity();
  if (lane == 0) warp_maps[warp] = incl;
  __syncthreads();

  if (warp == 0) {
    // Every lane composes the tile's map (cheap, and saves a broadcast).
    Affine tile_map = warp_maps[WARPS - 1];
#pragma unroll
    for (int w = WARPS - 2; w >= 0; --w) tile_map = compose(warp_maps[w], tile_map);
    float A = 0.f, V = 0.f;  // state entering the tile from the right
    if (tiles_per_row > 1) {
      volatile TileStatus* self = status + tile;
      if (from_right > 0) {
        if (lane == 0) {
          self->a = tile_map.a; self->b = tile_map.b; self->d = tile_map.d;
          self->e = tile_map.e; self->f = tile_map.f;
          __threadfence();
          self->flag = kFlagMap;
        }
        // Warp-wide look-back over windows of 32 tiles to the right (lane l: tile next - l) until
        // one of them has published its outgoing state; the row's last tile always does.
        const int64_t row_last = tile - from_right;
        Affine acc = affine_identity();
        for (int64_t next = tile - 1;; next -= 32) {
          const int64_t t = next - lane;
          const bool exists = t >= row_last;
          int flag = 0;
          if (exists) {
            volatile TileStatus* st = status + t;
            do { flag = st->flag; } while (flag == 0);
          }
          __threadfence();
          const unsigned with_state = __ballot_sync(0xffffffffu, exists && flag == kFlagState);
          const int stop = with_state ? __ffs(with_state) - 1 : 32;
          Affine m = affine_identity();
          float sA = 0.f, sV = 0.f;
          if (lane < stop) {
            volatile TileStatus* st = status + t;
            m = {st->a, st->b, st->d, st->e, st->f};
          } else if (lane == stop) {
            volatile TileStatus* st = status + t;
            sA = st->A; sV = st->V;
          }
          // Ordered composition m_0 ∘ m_1 ∘ ... ∘ m_{stop-1} (identity beyond), landing in lane 0.
#pragma unroll
          for (int off = 1; off < 32; off <<= 1) {
            const Affine other = shfl_down(m, off);
            if (lane + off < 32) m = compose(m, other);
          }
          const Affine window = {__shfl_sync(0xffffffffu, m.a, 0), __shfl_sync(0xffffffffu, m.b, 0),
                                 __shfl_sync(0xffffffffu, m.d, 0), __shfl_sync(0xffffffffu, m.e, 0),
                                 __shfl_sync(0xffffffffu, m.f, 0)};
          acc = compose(acc, window);
          if (stop < 32) {
            A = __shfl_sync(0xffffffffu, sA, stop);
            V = __shfl_sync(0xffffffffu, sV, stop);
            apply(acc, A, V);
            break;
          }
        }
      }
      if (lane == 0) {
        float A_out = A, V_out = V;
        apply(tile_map, A_out, V_out);
        self->A = A_out; self->V = V_out;
        __threadfence();
        self->flag = kFlagState;
      }
    }
    if (lane == 0) { carry[0] = A; carry[1] = V; }
  }
  __syncthreads();

  // State entering this thread's last position: carry, then the warps to the right, then the lanes.
  float A = carry[0], V = carry[1];
  for (int w = WARPS - 1; w > warp; --w) apply(warp_maps[w], A, V);
  apply(lane_excl, A, V);

  float adv[ITEMS], ret[ITEMS];
#pragma unroll
  for (int i = ITEMS - 1; i >= 0; --i) {
    if (valid[i]) {
      A = fmaf(c, A, fmaf(gamma, V, r[i] - v[i]));
      V = v[i];
      adv[i] = A;
      ret[i] = A + v[i];
    } else {
      adv[i] = 0.f;
      ret[i] = 0.f;
    }
  }
  store_items<ITEMS, VEC>(advantages + row * T, returns + row * T, pos, hi, adv, ret);

  if (tile_stats != nullptr) {
    // For fused whitening: (count, mean, M2) of this tile's valid advantages. Two passes over the
    // thread's registers, then pairwise (Chan et al.) merges, which stay accurate where
    // sum / sum-of-squares would cancel.
    float n = 0.f, sum = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (valid[i]) { n += 1.f; sum += adv[i]; }
    }
    float mean = n > 0.f ? sum / n : 0.f, m2 = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (valid[i]) { const float d = adv[i] - mean; m2 = fmaf(d, d, m2); }
    }
    __shared__ float part[WARPS][3];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float n2 = __shfl_down_sync(0xffffffffu, n, off);
      const float mean2 = __shfl_down_sync(0xffffffffu, mean, off);
      const float m22 = __shfl_down_sync(0xffffffffu, m2, off);
      merge_moments(n, mean, m2, n2, mean2, m22);
    }
    if (lane == 0) { part[warp][0] = n; part[warp][1] = mean; part[warp][2] = m2; }
    __syncthreads();
    if (tid == 0) {
      for (int w = 1; w < WARPS; ++w) merge_moments(n, mean, m2, part[w][0], part[w][1], part[w][2]);
      tile_stats[3 * tile] = n;
      tile_stats[3 * tile + 1] = mean;
      tile_stats[3 * tile + 2] = m2;
    }
  }
}

// y = valid ? (x - mean) * rstd : 0, in place; the second half of fused whitening.
template <typename MaskT>
__global__ void masked_normalize_kernel(float* __restrict__ x, const MaskT* __restrict__ mask, int64_t n,
                                        float mean, float rstd) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = is_valid(mask[i]) ? (x[i] - mean) * rstd : 0.f;
  }
}

// Whitening without a host round trip, part 1: one block pools the tiles' (count, mean, M2) in
// double, as verl_mcore.ops.gae.moments_from_tile_stats does (sum of counts, count-weighted mean,
// then sum of M2 + n (mean_i - mean)^2), and writes moments = (n, mean, var, rstd) with
// var = M2 / (n - 1) and rstd = 1 / sqrt(var + eps). For n < 2 the variance is undefined: the
// caller reads n and raises (the normalised values are then not used).
__device__ double block_sum(double x, double* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < warps; ++w) total += shared[w];
  return total;
}

__global__ void pool_moments_kernel(const float* __restrict__ tile_stats, int64_t tiles, double eps,
                                    double* __restrict__ moments) {
  __shared__ double shared[32];
  double n = 0.0, s = 0.0;
  for (int64_t i = threadIdx.x; i < tiles; i += blockDim.x) {
    const double ni = tile_stats[3 * i];
    n += ni;
    s += ni * double(tile_stats[3 * i + 1]);
  }
  n = block_sum(n, shared);
  s = block_sum(s, shared);
  const double mean = s / (n > 1.0 ? n : 1.0);
  double m2 = 0.0;
  for (int64_t i = threadIdx.x; i < tiles; i += blockDim.x) {
    const double d = double(tile_stats[3 * i + 1]) - mean;
    m2 += double(tile_stats[3 * i + 2]) + double(tile_stats[3 * i]) * d * d;
  }
  m2 = block_sum(m2, shared);
  if (threadIdx.x == 0) {
    const double var = m2 / (n > 1.0 ? n - 1.0 : 1.0);
    moments[0] = n;
    moments[1] = mean;
    moments[2] = var;
    moments[3] = 1.0 / sqrt(var + eps);
  }
}

// Part 2: masked_normalize_kernel with mean and rstd read from `moments` (float32, as
// masked_whiten casts them before the elementwise pass).
template <typename MaskT>
__global__ void masked_normalize_by_moments_kernel(float* __restrict__ x, const MaskT* __restrict__ mask,
                                                   int64_t n, const double* __restrict__ moments) {
  const float mean = float(moments[1]), rstd = float(moments[3]);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = is_valid(mask[i]) ? (x[i] - mean) * rstd : 0.f;
  }
}

struct GaeConfig {
  int warps, items;
};

// Tile shapes compiled in; `config` >= 0 picks one (benchmarks), -1 chooses by row length.
constexpr GaeConfig kConfigs[] = {{1, 4}, {1, 16}, {4, 16}, {8, 16}, {4, 8}, {8, 8}, {2, 16}};
constexpr int kNumConfigs = int(sizeof(kConfigs) / sizeof(kConfigs[0]));

// Short rows get small blocks (one tile a row, no look-back); long rows 4096-position tiles.
GaeConfig choose_config(int64_t T, int config) {
  if (config >= 0 && config < kNumConfigs) return kConfigs[config];
  if (T <= 128) return kConfigs[0];
  if (T <= 512) return kConfigs[1];
  if (T <= 2048) return kConfigs[2];
  return kConfigs[3];
}

template <int WARPS, int ITEMS, typename MaskT>
cudaError_t launch_with(const float* r, const float* v, const MaskT* m, float* adv, float* ret, int64_t B,
                        int64_t T, float gamma, float c, void* workspace, float* tile_stats, cudaStream_t stream) {
  constexpr int64_t TILE = int64_t(WARPS) * 32 * ITEMS;
  const int64_t tiles_per_row = (T + TILE - 1) / TILE;
  const int64_t tiles = B * tiles_per_row;
  TileStatus* status = nullptr;
  unsigned int* counter = nullptr;
  if (tiles_per_row > 1) {
    counter = static_cast<unsigned int*>(workspace);
    status = reinterpret_cast<TileStatus*>(static_cast<char*>(workspace) + 256);
  }
  const bool vec = (T % 4 == 0) && (reinterpret_cast<uintptr_t>(r) % 16 == 0) &&
                   (reinterpret_cast<uintptr_t>(v) % 16 == 0) && (reinterpret_cast<uintptr_t>(m) % (4 * sizeof(MaskT)) == 0) &&
                   (reinterpret_cast<uintptr_t>(adv) % 16 == 0) && (reinterpret_cast<uintptr_t>(ret) % 16 == 0);
  if (vec) {
    gae_kernel<WARPS, ITEMS, MaskT, true><<<dim3(unsigned(tiles)), WARPS * 32, 0, stream>>>(
        r, v, m, adv, ret, T, tiles_per_row, gamma, c, status, counter, tile_stats);
  } else {
    gae_kernel<WARPS, ITEMS, MaskT, false><<<dim3(unsigned(tiles)), WARPS * 32, 0, stream>>>(
        r, v, m, adv, ret, T, tiles_per_row, gamma, c, status, counter, tile_stats);
  }
  return cudaGetLastError();
}

template <typename MaskT>
cudaError_t launch_typed(const float* r, const float* v, const MaskT* m, float* adv, float* ret, int64_t B,
                         int64_t T, float gamma, float c, void* workspace, float* tile_stats, int config,
                         cudaStream_t stream) {
  const GaeConfig cfg = choose_config(T, config);
#define VERL_MCORE_GAE_CASE(W, I) \
  if (cfg.warps == W && cfg.items == I) return launch_with<W, I>(r, v, m, adv, ret, B, T, gamma, c, workspace, tile_stats, stream);
  VERL_MCORE_GAE_CASE(1, 4)
  VERL_MCORE_GAE_CASE(1, 16)
  VERL_MCORE_GAE_CASE(4, 16)
  VERL_MCORE_GAE_CASE(8, 16)
  VERL_MCORE_GAE_CASE(4, 8)
  VERL_MCORE_GAE_CASE(8, 8)
  VERL_MCORE_GAE_CASE(2, 16)
#undef VERL_MCORE_GAE_CASE
  return cudaErrorInvalidValue;
}

}  // namespace

int64_t gae_num_tiles(int64_t batch, int64_t T, int config) {
  const GaeConfig cfg = choose_config(T, config);
  const int64_t tile = int64_t(cfg.warps) * 32 * cfg.items;
  return batch * ((T + tile - 1) / tile);
}

size_t gae_workspace_bytes(int64_t batch, int64_t T, int config) {
  if (gae_num_tiles(1, T, config) <= 1) return 0;
  return 256 + size_t(gae_num_tiles(batch, T, config)) * sizeof(TileStatus);
}

cudaError_t gae_launch(const float* rewards, const float* values, const void* mask, MaskDtype mask_dtype,
                       float* advantages, float* returns, int64_t batch, int64_t T, float gamma, float lam,
                       void* workspace, float* tile_stats, int config, cudaStream_t stream) {
  if (batch <= 0 || T <= 0) return cudaSuccess;
  const float c = gamma * lam;
  if (mask_dtype == MaskDtype::kBool)
    return launch_typed(rewards, values, static_cast<const unsigned char*>(mask), advantages, returns, batch, T,
                        gamma, c, workspace, tile_stats, config, stream);
  return launch_typed(rewards, values, static_cast<const float*>(mask), advantages, returns, batch, T, gamma, c,
                      workspace, tile_stats, config, stream);
}

cudaError_t whiten_by_tile_stats_launch(float* x, const void* mask, MaskDtype mask_dtype, int64_t n,
                                        const float* tile_stats, int64_t tiles, double eps, double* moments,
                                        cudaStream_t stream) {
  pool_moments_kernel<<<1, 1024, 0, stream>>>(tile_stats, tiles, eps, moments);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || n <= 0) return err;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  const unsigned grid = unsigned(blocks < 65536 ? blocks : 65536);
  if (mask_dtype == MaskDtype::kBool)
    masked_normalize_by_moments_kernel<<<grid, threads, 0, stream>>>(x, static_cast<const unsigned char*>(mask), n,
                                                                     moments);
  else
    masked_normalize_by_moments_kernel<<<grid, threads, 0, stream>>>(x, static_cast<const float*>(mask), n, moments);
  return cudaGetLastError();
}

cudaError_t masked_normalize_launch(float* x, const void* mask, MaskDtype mask_dtype, int64_t n, float mean,
                                    float rstd, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  const unsigned grid = unsigned(blocks < 65536 ? blocks : 65536);
  if (mask_dtype == MaskDtype::kBool)
    masked_normalize_kernel<<<grid, threads, 0, stream>>>(x, static_cast<const unsigned char*>(mask), n, mean, rstd);
  else
    masked_normalize_kernel<<<grid, threads, 0, stream>>>(x, static_cast<const float*>(mask), n, mean, rstd);
  return cudaGetLastError();
}

}  // namespace verl_mcore
