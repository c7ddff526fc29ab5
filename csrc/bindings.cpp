// torch binding of the csrc/ kernels: checks arguments, allocates outputs, launches on the stream
// the caller passes (verl_mcore.ops passes torch.cuda.current_stream().cuda_stream). The only file
// of csrc/ that includes torch, and only its device-generic headers, so that CI machines with a CPU
// build of torch can compile it too (the .cu files include no torch at all).
#include <c10/core/DeviceGuard.h>
#include <cuda_runtime.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include "kernels.h"

namespace {

using at::Tensor;

// Error messages are built here with std::to_string, never by streaming a number through
// std::ostream (as TORCH_CHECK's message arguments are): on the GPU image, an integer streamed
// inside this extension segfaulted in libstdc++'s number formatting (FINDINGS.md), so a bad
// argument crashed the process instead of raising. TORCH_CHECK then gets one std::string, which
// c10 passes through without a stream.
void put(std::string& s, const char* v) { s += v; }
void put(std::string& s, const std::string& v) { s += v; }
template <typename I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
void put(std::string& s, I v) { s += std::to_string(v); }
void put(std::string& s, double v) { s += std::to_string(v); }
void put(std::string& s, c10::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += "]";
}
void put(std::string& s, at::ScalarType v) { s += c10::toString(v); }
void put(std::string& s, const c10::Device& v) { s += v.str(); }

template <typename... A>
std::string message(const A&... args) {
  std::string s;
  (put(s, args), ...);
  return s;
}

#define VM_CHECK(cond, ...) TORCH_CHECK(cond, message(__VA_ARGS__))

void check_cuda(cudaError_t err, const char* what) {
  VM_CHECK(err == cudaSuccess, "verl_mcore._C.", what, ": CUDA error: ", cudaGetErrorString(err));
}

void check_on_device(const Tensor& t, const char* name, const Tensor& like, const char* op) {
  VM_CHECK(t.is_cuda(), "verl_mcore._C.", op, ": ", name, " must be a CUDA tensor");
  VM_CHECK(t.device() == like.device(), "verl_mcore._C.", op, ": ", name, " is on ", t.device(),
              " but the other inputs are on ", like.device());
}

cudaStream_t to_stream(int64_t stream) { return reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(stream)); }

verl_mcore::FloatDtype float_dtype(const Tensor& t, const char* name, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return verl_mcore::FloatDtype::kFloat32;
    case at::kBFloat16: return verl_mcore::FloatDtype::kBFloat16;
    case at::kHalf: return verl_mcore::FloatDtype::kFloat16;
    default:
      VM_CHECK(false, "verl_mcore._C.", op, ": ", name, " must be float32, bfloat16 or float16, got ",
                  t.scalar_type());
  }
}

verl_mcore::MaskDtype mask_dtype_of(const Tensor& mask, const char* op) {
  if (mask.scalar_type() == at::kBool || mask.scalar_type() == at::kByte) return verl_mcore::MaskDtype::kBool;
  VM_CHECK(mask.scalar_type() == at::kFloat, "verl_mcore._C.", op, ": mask must be bool, uint8 or float32, got ",
              mask.scalar_type());
  return verl_mcore::MaskDtype::kFloat32;
}

// rewards, values: float32 [batch, T]; mask: bool/uint8 or float32 [batch, T]; config: see kernels.h.
// Returns (advantages, returns) float32 [batch, T], and with `with_stats` each scan tile's
// (count, mean, M2) of valid advantages, float32 [tiles, 3] (else an empty tensor).
std::tuple<Tensor, Tensor, Tensor> gae(Tensor rewards, Tensor values, Tensor mask, double gamma, double lam,
                                       int64_t stream, int64_t config, bool with_stats) {
  VM_CHECK(rewards.dim() == 2, "verl_mcore._C.gae: rewards must be [batch, T], got shape ", rewards.sizes());
  VM_CHECK(values.sizes() == rewards.sizes() && mask.sizes() == rewards.sizes(),
              "verl_mcore._C.gae: rewards ", rewards.sizes(), ", values ", values.sizes(), " and mask ",
              mask.sizes(), " must have the same shape");
  check_on_device(rewards, "rewards", rewards, "gae");
  check_on_device(values, "values", rewards, "gae");
  check_on_device(mask, "mask", rewards, "gae");
  VM_CHECK(rewards.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "verl_mcore._C.gae: rewards and values must be float32");
  const verl_mcore::MaskDtype mask_dtype = mask_dtype_of(mask, "gae");
  const c10::DeviceGuard guard(rewards.device());
  rewards = rewards.contiguous();
  values = values.contiguous();
  mask = mask.contiguous();
  const int64_t B = rewards.size(0), T = rewards.size(1);
  Tensor adv = at::empty_like(rewards);
  Tensor ret = at::empty_like(rewards);
  const size_t ws_bytes = verl_mcore::gae_workspace_bytes(B, T, int(config));
  Tensor ws;
  if (ws_bytes > 0) ws = at::zeros({int64_t(ws_bytes)}, rewards.options().dtype(at::kByte));
  Tensor tile_stats = at::empty({with_stats ? verl_mcore::gae_num_tiles(B, T, int(config)) : 0, 3},
                                rewards.options());
  check_cuda(verl_mcore::gae_launch(rewards.data_ptr<float>(), values.data_ptr<float>(), mask.data_ptr(), mask_dtype,
                                    adv.data_ptr<float>(), ret.data_ptr<float>(), B, T, float(gamma), float(lam),
                                    ws_bytes > 0 ? ws.data_ptr() : nullptr,
                                    with_stats ? tile_stats.data_ptr<float>() : nullptr, int(config),
                                    to_stream(stream)),
             "gae");
  return {adv, ret, tile_stats};
}

// x[i] = mask[i] ? (x[i] - mean) * rstd : 0, in place. x: contiguous float32; mask: same shape.
void masked_normalize_(Tensor x, Tensor mask, double mean, double rstd, int64_t stream) {
  VM_CHECK(x.sizes() == mask.sizes(), "verl_mcore._C.masked_normalize_: x ", x.sizes(), " and mask ", mask.sizes(),
              " must have the same shape");
  check_on_device(x, "x", x, "masked_normalize_");
  check_on_device(mask, "mask", x, "masked_normalize_");
  VM_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(),
              "verl_mcore._C.masked_normalize_: x must be a contiguous float32 tensor");
  const verl_mcore::MaskDtype mask_dtype = mask_dtype_of(mask, "masked_normalize_");
  const c10::DeviceGuard guard(x.device());
  mask = mask.contiguous();
  check_cuda(verl_mcore::masked_normalize_launch(x.data_ptr<float>(), mask.data_ptr(), mask_dtype, x.numel(),
                                                 float(mean), float(rstd), to_stream(stream)),
             "masked_normalize_");
}

// Whiten x in place from gae's tile statistics, on the device; returns moments float64 [4] =
// (n, mean, var, rstd) on x's device (the caller reads n to refuse n < 2).
Tensor whiten_by_tile_stats_(Tensor x, Tensor mask, Tensor tile_stats, double eps, int64_t stream) {
  VM_CHECK(x.sizes() == mask.sizes(), "verl_mcore._C.whiten_by_tile_stats_: x ", x.sizes(), " and mask ",
              mask.sizes(), " must have the same shape");
  check_on_device(x, "x", x, "whiten_by_tile_stats_");
  check_on_device(mask, "mask", x, "whiten_by_tile_stats_");
  check_on_device(tile_stats, "tile_stats", x, "whiten_by_tile_stats_");
  VM_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(),
              "verl_mcore._C.whiten_by_tile_stats_: x must be a contiguous float32 tensor");
  VM_CHECK(tile_stats.scalar_type() == at::kFloat && tile_stats.dim() == 2 && tile_stats.size(1) == 3 &&
                  tile_stats.is_contiguous(),
              "verl_mcore._C.whiten_by_tile_stats_: tile_stats must be contiguous float32 [tiles, 3]");
  const verl_mcore::MaskDtype mask_dtype = mask_dtype_of(mask, "whiten_by_tile_stats_");
  const c10::DeviceGuard guard(x.device());
  mask = mask.contiguous();
  Tensor moments = at::empty({4}, x.options().dtype(at::kDouble));
  check_cuda(verl_mcore::whiten_by_tile_stats_launch(x.data_ptr<float>(), mask.data_ptr(), mask_dtype, x.numel(),
                                                     tile_stats.data_ptr<float>(), tile_stats.size(0), eps,
                                                     moments.data_ptr<double>(), to_stream(stream)),
             "whiten_by_tile_stats_");
  return moments;
}

Tensor rows_with_unit_stride(const Tensor& logits) {
  return logits.stride(1) == 1 ? logits : logits.contiguous();
}

// logits: [tokens, V_local]; target: int64 [tokens]. Returns float32 [tokens, 4] local statistics
// (see csrc/kernels.h).
Tensor lpe_forward(Tensor logits, Tensor target, int64_t vocab_start, double inv_temp, int64_t stream) {
  VM_CHECK(logits.dim() == 2, "verl_mcore._C.lpe_forward: logits must be [tokens, V_local], got ", logits.sizes());
  VM_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), "verl_mcore._C.lpe_forward: target must be [",
              logits.size(0), "], got ", target.sizes());
  VM_CHECK(target.scalar_type() == at::kLong, "verl_mcore._C.lpe_forward: target must be int64");
  check_on_device(logits, "logits", logits, "lpe_forward");
  check_on_device(target, "target", logits, "lpe_forward");
  const auto dtype = float_dtype(logits, "logits", "lpe_forward");
  const c10::DeviceGuard guard(logits.device());
  logits = rows_with_unit_stride(logits);
  target = target.contiguous();
  Tensor stats = at::empty({logits.size(0), 4}, logits.options().dtype(at::kFloat));
  check_cuda(verl_mcore::lpe_forward_launch(logits.data_ptr(), dtype, logits.stride(0), target.data_ptr<int64_t>(),
                                            logits.size(0), logits.size(1), vocab_start, float(inv_temp),
                                            stats.data_ptr<float>(), to_stream(stream)),
             "lpe_forward");
  return stats;
}

// Returns grad_logits [tokens, V_local] in the logits' dtype. logZ, Ez, g_logp, g_ent: float32 [tokens].
Tensor lpe_backward(Tensor logits, Tensor target, int64_t vocab_start, double inv_temp, Tensor logZ, Tensor Ez,
                    Tensor g_logp, Tensor g_ent, int64_t stream) {
  VM_CHECK(logits.dim() == 2, "verl_mcore._C.lpe_backward: logits must be [tokens, V_local], got ", logits.sizes());
  const int64_t N = logits.size(0);
  const char* names[] = {"target", "logZ", "Ez", "g_logp", "g_ent"};
  Tensor* per_token[] = {&target, &logZ, &Ez, &g_logp, &g_ent};
  for (int i = 0; i < 5; ++i) {
    VM_CHECK(per_token[i]->dim() == 1 && per_token[i]->size(0) == N, "verl_mcore._C.lpe_backward: ", names[i],
                " must be [", N, "], got ", per_token[i]->sizes());
    check_on_device(*per_token[i], names[i], logits, "lpe_backward");
    VM_CHECK(per_token[i]->scalar_type() == (i == 0 ? at::kLong : at::kFloat),
                "verl_mcore._C.lpe_backward: ", names[i], " must be ", i == 0 ? "int64" : "float32");
    *per_token[i] = per_token[i]->contiguous();
  }
  check_on_device(logits, "logits", logits, "lpe_backward");
  const auto dtype = float_dtype(logits, "logits", "lpe_backward");
  const c10::DeviceGuard guard(logits.device());
  logits = rows_with_unit_stride(logits);
  Tensor grad = at::empty({N, logits.size(1)}, logits.options());
  check_cuda(verl_mcore::lpe_backward_launch(logits.data_ptr(), dtype, logits.stride(0), target.data_ptr<int64_t>(),
                                             N, logits.size(1), vocab_start, float(inv_temp), logZ.data_ptr<float>(),
                                             Ez.data_ptr<float>(), g_logp.data_ptr<float>(), g_ent.data_ptr<float>(),
                                             grad.data_ptr(), grad.stride(0), to_stream(stream)),
             "lpe_backward");
  return grad;
}

void check_same(const Tensor& t, const char* name, const Tensor& like, const char* op) {
  check_on_device(t, name, like, op);
  VM_CHECK(t.scalar_type() == like.scalar_type(), "verl_mcore._C.", op, ": ", name, " is ", t.scalar_type(),
              " but the other inputs are ", like.scalar_type());
  VM_CHECK(t.is_contiguous(), "verl_mcore._C.", op, ": ", name, " must be contiguous");
}

// residual: [..., hidden] contiguous; delta: None or like residual (then residual += delta in place);
// weight: [hidden]. Returns rmsnorm(residual) * weight, like residual.
Tensor rmsnorm(Tensor residual, std::optional<Tensor> delta, Tensor weight, double eps, int64_t stream) {
  check_same(residual, "residual", residual, "rmsnorm");
  check_same(weight, "weight", residual, "rmsnorm");
  const int64_t hidden = residual.size(-1);
  VM_CHECK(weight.dim() == 1 && weight.size(0) == hidden, "verl_mcore._C.rmsnorm: weight must be [", hidden,
              "], got ", weight.sizes());
  if (delta) {
    check_same(*delta, "delta", residual, "rmsnorm");
    VM_CHECK(delta->sizes() == residual.sizes(), "verl_mcore._C.rmsnorm: delta ", delta->sizes(),
                " and residual ", residual.sizes(), " differ in shape");
  }
  const c10::DeviceGuard guard(residual.device());
  Tensor out = at::empty_like(residual);
  check_cuda(verl_mcore::rmsnorm_launch(residual.data_ptr(), delta ? delta->data_ptr() : nullptr, weight.data_ptr(),
                                        out.data_ptr(), float_dtype(residual, "residual", "rmsnorm"), residual.numel() / hidden,
                                        hidden, float(eps), to_stream(stream)),
             "rmsnorm");
  return out;
}

// qkv: [tokens, groups * (r + 2) * hd] contiguous; cos/sin: [max_pos, hd]; positions, rows: int64 [tokens];
// cache_k/cache_v: [cache rows, groups, hd] contiguous (a paged cache's blocks, flattened). Returns q
// [tokens, groups * r, hd]; k and v of token t go to cache row rows[t].
Tensor rope_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor rows, Tensor cache_k, Tensor cache_v,
                  int64_t groups, int64_t r, int64_t hd, int64_t stream) {
  const char* op = "rope_cache";
  check_same(qkv, "qkv", qkv, op);
  check_same(cos, "cos", qkv, op);
  check_same(sin, "sin", qkv, op);
  check_same(cache_k, "cache_k", qkv, op);
  check_same(cache_v, "cache_v", qkv, op);
  check_on_device(positions, "positions", qkv, op);
  check_on_device(rows, "rows", qkv, op);
  VM_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1,
              "verl_mcore._C.rope_cache: positions must be a contiguous int64 vector");
  const int64_t tokens = positions.size(0);
  VM_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 1 && rows.size(0) == tokens,
              "verl_mcore._C.rope_cache: rows must be a contiguous int64 vector like positions");
  VM_CHECK(qkv.numel() == tokens * groups * (r + 2) * hd, "verl_mcore._C.rope_cache: qkv has ", qkv.numel(),
              " elements, expected tokens x groups x (r + 2) x hd = ", tokens, " x ", groups, " x ", r + 2, " x ", hd);
  VM_CHECK(cos.dim() == 2 && cos.size(1) == hd && sin.sizes() == cos.sizes(),
              "verl_mcore._C.rope_cache: cos/sin must be [max_pos, ", hd, "]");
  VM_CHECK(hd % 2 == 0, "verl_mcore._C.rope_cache: head dim must be even, got ", hd);
  VM_CHECK(cache_k.dim() == 3 && cache_k.sizes() == cache_v.sizes() && cache_k.size(1) == groups &&
                  cache_k.size(2) == hd,
              "verl_mcore._C.rope_cache: caches must be [rows, ", groups, ", ", hd, "], got ", cache_k.sizes(),
              " and ", cache_v.sizes());
  const c10::DeviceGuard guard(qkv.device());
  Tensor q = at::empty({tokens, groups * r, hd}, qkv.options());
  check_cuda(verl_mcore::rope_cache_launch(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                           positions.data_ptr<int64_t>(), rows.data_ptr<int64_t>(), q.data_ptr(),
                                           cache_k.data_ptr(), cache_v.data_ptr(), float_dtype(qkv, "qkv", op), tokens,
                                           int(groups), int(r), int(hd), to_stream(stream)),
             op);
  return q;
}

// x: [..., 2f] contiguous. Returns silu(x[..., :f]) * x[..., f:], [..., f] like x.
Tensor swiglu(Tensor x, int64_t stream) {
  check_same(x, "x", x, "swiglu");
  VM_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "verl_mcore._C.swiglu: x must be [..., 2f], got ", x.sizes());
  const int64_t f = x.size(-1) / 2;
  auto shape = x.sizes().vec();
  shape.back() = f;
  const c10::DeviceGuard guard(x.device());
  Tensor out = at::empty(shape, x.options());
  check_cuda(verl_mcore::swiglu_launch(x.data_ptr(), out.data_ptr(), float_dtype(x, "x", "swiglu"),
                                       f ? x.numel() / (2 * f) : 0, f, to_stream(stream)),
             "swiglu");
  return out;
}

// logits: [rows, >= vocab] (row-major, unit column stride: a column slice of the padded logits is
// fine); u: float64 [rows] (None when greedy, temperature 0). Returns (tokens int64 [rows], logp
// float32 [rows]): sampling.py `sample` without top-k/top-p and `token_logprobs`, in one kernel.
std::tuple<Tensor, Tensor> sample(Tensor logits, int64_t vocab, double temperature, std::optional<Tensor> u,
                                  int64_t stream) {
  const char* op = "sample";
  check_on_device(logits, "logits", logits, op);
  VM_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) >= vocab && vocab >= 1 &&
                  vocab <= int64_t(12000) * 256 && logits.size(0) <= 0x7fffffff,
              "verl_mcore._C.sample: logits must be [rows < 2^31, >= vocab] with unit column stride and vocab in "
              "[1, 3072000], got ", logits.sizes(), " strides ", logits.strides(), " vocab ", vocab);
  const bool greedy = temperature == 0.0;
  VM_CHECK(greedy || temperature > 0.0, "verl_mcore._C.sample: temperature must be >= 0, got ", temperature);
  const int64_t rows = logits.size(0);
  if (!greedy) {
    VM_CHECK(u.has_value(), "verl_mcore._C.sample: u is required unless temperature is 0");
    check_on_device(*u, "u", logits, op);
    VM_CHECK(u->scalar_type() == at::kDouble && u->is_contiguous() && u->dim() == 1 && u->size(0) == rows,
                "verl_mcore._C.sample: u must be contiguous float64 [", rows, "], got ", u->scalar_type(), " ",
                u->sizes());
  }
  const c10::DeviceGuard guard(logits.device());
  Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  Tensor logp = at::empty({rows}, logits.options().dtype(at::kFloat));
  check_cuda(verl_mcore::sample_launch(logits.data_ptr(), float_dtype(logits, "logits", op), rows, logits.stride(0),
                                       vocab, greedy ? 1.f : float(1.0 / temperature), greedy,
                                       greedy ? nullptr : u->data_ptr<double>(), tokens.data_ptr<int64_t>(),
                                       logp.data_ptr<float>(), to_stream(stream)),
             op);
  return {tokens, logp};
}

// q: [b, heads, hd]; cache_k/cache_v: [blocks, block_size, groups, hd]; block_table: int32 [b, width];
// seq_lens: int32 [b]. Returns out [b, heads, hd] like q (see csrc/kernels.h). The split partials'
// workspace is allocated here from the shapes alone, so a captured CUDA graph replays for any lengths.
Tensor paged_attention(Tensor q, Tensor cache_k, Tensor cache_v, Tensor block_table, Tensor seq_lens, double scale,
                       int64_t splits, int64_t stream) {
  const char* op = "paged_attention";
  check_same(q, "q", q, op);
  check_same(cache_k, "cache_k", q, op);
  check_same(cache_v, "cache_v", q, op);
  check_on_device(block_table, "block_table", q, op);
  check_on_device(seq_lens, "seq_lens", q, op);
  VM_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "verl_mcore._C.paged_attention: q and the caches must be bfloat16 or float16, got ", q.scalar_type());
  VM_CHECK(q.dim() == 3, "verl_mcore._C.paged_attention: q must be [b, heads, hd], got ", q.sizes());
  const int64_t b = q.size(0), heads = q.size(1), hd = q.size(2);
  VM_CHECK(cache_k.dim() == 4 && cache_k.sizes() == cache_v.sizes() && cache_k.size(3) == hd &&
                  cache_k.size(0) >= 1 && cache_k.size(1) >= 1,
              "verl_mcore._C.paged_attention: caches must be [blocks >= 1, block_size >= 1, groups, ", hd,
              "] (q's head dim), got ", cache_k.sizes(), " and ", cache_v.sizes());
  const int64_t block_size = cache_k.size(1), groups = cache_k.size(2);
  VM_CHECK(groups >= 1 && heads % groups == 0, "verl_mcore._C.paged_attention: q's ", heads,
              " heads are not a multiple of the caches' ", groups, " KV groups");
  VM_CHECK(hd % 8 == 0 && hd >= 8 && hd <= 256, "verl_mcore._C.paged_attention: head dim must be a multiple of 8 "
              "in [8, 256], got ", hd);
  VM_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && block_table.dim() == 2 &&
                  block_table.size(0) == b && block_table.size(1) >= 1,
              "verl_mcore._C.paged_attention: block_table must be contiguous int32 [", b, ", width >= 1], got ",
              block_table.scalar_type(), " ", block_table.sizes());
  VM_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == b,
              "verl_mcore._C.paged_attention: seq_lens must be contiguous int32 [", b, "], got ",
              seq_lens.scalar_type(), " ", seq_lens.sizes());
  const int64_t width = block_table.size(1);
  VM_CHECK(width * block_size < (int64_t(1) << 30), "verl_mcore._C.paged_attention: a block table of ", width,
              " blocks of ", block_size, " tokens exceeds the kernel's 2^30 keys a sequence");
  VM_CHECK(splits >= 1 && splits <= 1024, "verl_mcore._C.paged_attention: splits must be in [1, 1024], got ",
              splits);
  for (const Tensor* t : {&q, &cache_k, &cache_v}) {
    VM_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "verl_mcore._C.paged_attention: q, cache_k and cache_v must start 16-byte aligned (the kernel reads "
                "16-byte vectors); pass a contiguous copy");
  }
  const c10::DeviceGuard guard(q.device());
  Tensor out = at::empty_like(q);
  Tensor part_acc, part_ml;
  if (splits > 1) {
    part_acc = at::empty({b, heads, splits, hd}, q.options().dtype(at::kFloat));
    part_ml = at::empty({b, heads, splits, 2}, q.options().dtype(at::kFloat));
  }
  check_cuda(verl_mcore::paged_attention_launch(
                 q.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), block_table.data_ptr<int32_t>(),
                 seq_lens.data_ptr<int32_t>(), out.data_ptr(), splits > 1 ? part_acc.data_ptr<float>() : nullptr,
                 splits > 1 ? part_ml.data_ptr<float>() : nullptr, float_dtype(q, "q", op), b, int(heads), int(groups),
                 int(hd), int(block_size), int(width), int(splits), float(scale), to_stream(stream)),
             op);
  return out;
}

// keys, steps: int64 [n] contiguous on one GPU. Returns the sampler's uniforms, float64 [n].
Tensor uniforms(Tensor keys, Tensor steps, int64_t stream) {
  const char* op = "uniforms";
  check_on_device(keys, "keys", keys, op);
  check_on_device(steps, "steps", keys, op);
  VM_CHECK(keys.scalar_type() == at::kLong && steps.scalar_type() == at::kLong && keys.is_contiguous() &&
                  steps.is_contiguous() && keys.dim() == 1 && steps.sizes() == keys.sizes(),
              "verl_mcore._C.uniforms: keys and steps must be contiguous int64 vectors of one length");
  const c10::DeviceGuard guard(keys.device());
  Tensor out = at::empty({keys.size(0)}, keys.options().dtype(at::kDouble));
  check_cuda(verl_mcore::uniforms_launch(keys.data_ptr<int64_t>(), steps.data_ptr<int64_t>(),
                                         out.data_ptr<double>(), keys.size(0), to_stream(stream)),
             op);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "verl_mcore CUDA kernels (csrc/); use them through verl_mcore.ops";
  m.def("gae", &gae,
        "batched masked GAE: (rewards, values, mask, gamma, lam, stream, config=-1, with_stats=False) -> "
        "(advantages, returns, tile_stats)",
        py::arg("rewards"), py::arg("values"), py::arg("mask"), py::arg("gamma"), py::arg("lam"), py::arg("stream"),
        py::arg("config") = -1, py::arg("with_stats") = false);
  m.def("masked_normalize_", &masked_normalize_, "x = mask ? (x - mean) * rstd : 0, in place");
  m.def("whiten_by_tile_stats_", &whiten_by_tile_stats_,
        "whiten x in place from gae's tile statistics on the device; returns (n, mean, var, rstd)");
  m.def("lpe_forward", &lpe_forward, "local log-prob/entropy statistics of vocab-parallel logits");
  m.def("lpe_backward", &lpe_backward, "grad-logits of log-prob and entropy from saved statistics");
  m.def("rmsnorm", &rmsnorm, "[residual += delta;] rmsnorm(residual) * weight (decode step)",
        py::arg("residual"), py::arg("delta"), py::arg("weight"), py::arg("eps"), py::arg("stream"));
  m.def("rope_cache", &rope_cache, "rotary q/k of fused QKV rows; k, v into the KV cache (decode step)");
  m.def("paged_attention", &paged_attention,
        "decode attention over a paged KV cache: (q, cache_k, cache_v, block_table, seq_lens, scale, splits, "
        "stream) -> out",
        py::arg("q"), py::arg("cache_k"), py::arg("cache_v"), py::arg("block_table"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("splits"), py::arg("stream"));
  m.def("swiglu", &swiglu, "silu(gate) * up of the MLP's fused gate/up rows (decode step)",
        py::arg("x"), py::arg("stream"));
  m.def("sample", &sample, "the sampler without top-k/top-p, with the tokens' log-probs: (logits, vocab, "
        "temperature, u, stream) -> (tokens, logp)",
        py::arg("logits"), py::arg("vocab"), py::arg("temperature"), py::arg("u"), py::arg("stream"));
  m.def("uniforms", &uniforms, "the sampler's counter-based uniforms of (key, step) pairs");
}
