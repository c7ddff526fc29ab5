// Launchers for the verl_mcore CUDA kernels.
//
// The .cu files include only CUDA headers (no torch), so CI machines with nvcc but a CPU build of
// torch can compile them; csrc/bindings.cpp is the one file that talks to torch. Every launcher
// enqueues on `stream` and returns the launch's cudaError_t (cudaGetLastError after the launch).
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

namespace verl_mcore {

// Element types of float tensors: the logits (and the grad-logits the backward writes), the
// activations, weights and KV cache of the decode ops.
enum class FloatDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Element types of the GAE mask: 1 byte (bool / uint8) or float32; nonzero means "valid token".
enum class MaskDtype : int { kBool = 0, kFloat32 = 1 };

// ---------------------------------------------------------------------------------------------
// GAE. rewards, values, mask, advantages, returns: [batch, T], contiguous rows.
// Reverse recurrence over valid positions (mask != 0); masked positions carry the next valid
// value and advantage through and get advantage = return = 0.
// `workspace` must hold gae_workspace_bytes(batch, T, config) bytes, zeroed before the launch
// (look-back flags and the tile counter of the chunked scan; may be null when that is 0).
// `tile_stats`: null, or [gae_num_tiles(batch, T, config), 3] float32 receiving each tile's
// (count, mean, M2) of valid advantages, for fused whitening.
// `config`: -1 picks the tile shape by row length; 0..6 force one (for benchmarks, see gae.cu).
int64_t gae_num_tiles(int64_t batch, int64_t T, int config);
size_t gae_workspace_bytes(int64_t batch, int64_t T, int config);
cudaError_t gae_launch(const float* rewards, const float* values, const void* mask, MaskDtype mask_dtype,
                       float* advantages, float* returns, int64_t batch, int64_t T, float gamma, float lam,
                       void* workspace, float* tile_stats, int config, cudaStream_t stream);

// x[i] = mask[i] != 0 ? (x[i] - mean) * rstd : 0 over n contiguous elements, in place.
cudaError_t masked_normalize_launch(float* x, const void* mask, MaskDtype mask_dtype, int64_t n, float mean,
                                    float rstd, cudaStream_t stream);

// Fused whitening with no host round trip: pool `tile_stats` [tiles, 3] (gae_launch's) in double
// into moments [4] float64 = (n, mean, unbiased var, 1 / sqrt(var + eps)), then normalise x as
// masked_normalize_launch does with that mean and rstd, all on `stream`. The caller checks n >= 2.
cudaError_t whiten_by_tile_stats_launch(float* x, const void* mask, MaskDtype mask_dtype, int64_t n,
                                        const float* tile_stats, int64_t tiles, double eps, double* moments,
                                        cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Vocab-parallel log-prob + entropy, local (per-shard) statistics.
// logits: [tokens, V_local] with row stride `row_stride` elements (unit column stride).
// target: [tokens] int64 global vocabulary ids; this shard holds [vocab_start, vocab_start + V_local).
// stats:  [tokens, 4] float32, per token in the temperature-scaled domain z = logits * inv_temp:
//         (m = local max of z, s = sum exp(z - m), sd = sum exp(z - m) * (z - m), z_target or 0).
cudaError_t lpe_forward_launch(const void* logits, FloatDtype dtype, int64_t row_stride, const int64_t* target,
                               int64_t tokens, int64_t vocab_local, int64_t vocab_start, float inv_temp,
                               float* stats, cudaStream_t stream);

// Backward: grad_logits[i, j] = inv_temp * (g_logp[i] * (1[j == target_i] - p_ij)
//                                          - g_ent[i] * p_ij * (z_ij - Ez[i])),
// p_ij = exp(z_ij - logZ[i]); logZ and Ez are the global (all shards) statistics, float32 [tokens].
// grad_logits has the logits' dtype and row stride `grad_row_stride`.
cudaError_t lpe_backward_launch(const void* logits, FloatDtype dtype, int64_t row_stride, const int64_t* target,
                                int64_t tokens, int64_t vocab_local, int64_t vocab_start, float inv_temp,
                                const float* logZ, const float* Ez, const float* g_logp, const float* g_ent,
                                void* grad_logits, int64_t grad_row_stride, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Decode-step ops of the native rollout engine (forward only, csrc/decode.cu).

// Activations, weights and the KV cache share one FloatDtype in a call.
// RMSNorm of `rows` contiguous rows of `hidden`: out = round(h * rstd(h)) * weight, with
// h = residual, or, when `delta` is not null, residual += delta first (in place) and h the sum.
cudaError_t rmsnorm_launch(void* residual, const void* delta, const void* weight, void* out, FloatDtype dtype,
                           int64_t rows, int64_t hidden, float eps, cudaStream_t stream);

// out[i] = the sampler's uniform of sequence key keys[i] at step steps[i] (bit patterns of uint64 keys
// in int64; verl_mcore/rollout/sampling.py `uniforms`).
cudaError_t uniforms_launch(const int64_t* keys, const int64_t* steps, double* out, int64_t n, cudaStream_t stream);

// One token per sequence: qkv [tokens, groups, r + 2, hd] (megatron's group-interleaved fused QKV,
// r query heads per group); cos/sin [max_pos, hd]; positions int64 [tokens]. Writes the rotated
// queries to q_out [tokens, groups * r, hd], the rotated key and the value of token t into row
// rows[t] of cache_k / cache_v [cache rows, groups, hd] (a paged cache's blocks, flattened).
cudaError_t rope_cache_launch(const void* qkv, const void* cos, const void* sin, const int64_t* positions,
                              const int64_t* rows, void* q_out, void* cache_k, void* cache_v, FloatDtype dtype,
                              int64_t tokens, int groups, int r, int hd, cudaStream_t stream);

// out [rows, f] = silu(x[:, :f]) * x[:, f:] of x [rows, 2f], both contiguous; silu(gate) is rounded
// to the dtype before the product (torch's `F.silu(gate) * up`).
cudaError_t swiglu_launch(const void* x, void* out, FloatDtype dtype, int64_t rows, int64_t f, cudaStream_t stream);

// The sampler (csrc/sampling.cu): per row of logits [rows, row_stride] (its first `vocab` entries),
// a token from softmax(logits * inv_temp) by the inverse CDF at u[row] (256-entry blocks, then the
// entry), or with `greedy` the first largest logit; tokens int64 [rows]; logp (may be null) float32
// [rows] = the token's log softmax(logits * inv_temp) (inv_temp taken as 1 when greedy). u is not
// read when greedy (may be null). vocab <= 12,000 x 256, rows < 2^31. A row whose max is not finite or
// whose mass is 0 gets its argmax (torch's argmax: the first NaN, else the first maximum).
cudaError_t sample_launch(const void* logits, FloatDtype dtype, int64_t rows, int64_t row_stride, int64_t vocab,
                          float inv_temp, bool greedy, const double* u, int64_t* tokens, float* logp,
                          cudaStream_t stream);

// Decode attention over a paged KV cache (csrc/paged_attention.cu), bf16 or fp16 (kFloat32 returns
// cudaErrorInvalidValue). q, out: [batch, heads, hd]; cache_k, cache_v: [blocks, block_size,
// groups, hd]; block_table: int32 [batch, width]; seq_lens: int32 [batch]. Sequence i's key p (for
// p < seq_lens[i]) is row p % block_size of block block_table[i, p / block_size]; head h reads KV
// group h / (heads / groups). out = softmax(q k^T * scale) v per head, accumulated in fp32 (a length
// past width * block_size reads the whole row; a length <= 0 gives zeros). All of q, cache_k,
// cache_v, out contiguous and 16-byte aligned; hd a multiple of 8, at most 256; width *
// block_size < 2^30. With splits > 1, part_acc [batch, heads, splits, hd] and part_ml [batch,
// heads, splits, 2] float32 are the split partials (no initialisation needed); else both may be
// null.
cudaError_t paged_attention_launch(const void* q, const void* cache_k, const void* cache_v,
                                   const int32_t* block_table, const int32_t* seq_lens, void* out, float* part_acc,
                                   float* part_ml, FloatDtype dtype, int64_t batch, int heads, int groups, int hd,
                                   int block_size, int width, int splits, float scale, cudaStream_t stream);

}  // namespace verl_mcore
