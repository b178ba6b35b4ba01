// zenflow::adamw_step_ -- one in-place Adam(W) step over contiguous CPU tensors.
//
// Stateless: the caller owns the fp32 master (param), the fp32 moments and the step
// counter. Arithmetic follows torch.optim.AdamW's single-tensor loop:
//
//   g  = grad * grad_scale                 (grad fp32 or bf16; grad_scale = 1/S averages a
//                                           window's gradient sum in the same pass)
//   AdamW: p *= 1 - lr*wd                  Adam: g += wd*p   (L2)
//   m  = b1*m + (1-b1)*g
//   v  = b2*v + (1-b2)*g*g
//   p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
//   param_bf16 (optional) = bf16(p), round to nearest even, written in the same pass.
//
// Bias corrections are computed once per call in double; the inner loop is all fp32.
// Two rewrites differ from torch by at most an ulp per operation: the division by
// sqrt(1-b2^t) is a multiplication by its reciprocal, and mul+add pairs are fused (FMA).
//
// Per-column step counts (ZenFlow hands columns of a weight between the device and the
// host, and each column keeps its own Adam step count). With col_steps (int64, C >= 1
// entries, each >= 1) the bias-correction step t of element i of the flattened param is
//
//   col_steps[(i / col_inner) % C]          (numel must be a multiple of C * col_inner)
//
// and the scalar `step` is not used for bias correction (it is still checked, >= 1).
// Layouts: an nn.Linear weight [out, in] with columns along dim 1 has col_inner = 1,
// C = in; a transformers Conv1D weight [in, out] with columns along dim 0 has
// col_inner = out, C = in. The two step-dependent constants (-lr/(1-b1^t) and
// 1/sqrt(1-b2^t)) are computed per column once per call, in double then cast to float,
// by the same function as the scalar-step path, into tables of C floats. So a call whose
// col_steps all equal `step` is bit-identical to the scalar-step call. The loops then read:
//   col_inner == 1: a new column every element. The tables are extended by one vector
//     width with wrap-around (ext[j] = base[j % C]), so a vector starting at any column
//     c < C loads its kWidth constants with one unaligned load, also across a row
//     boundary and when C < kWidth.
//   col_inner > 1: runs of col_inner elements share one column; each run broadcasts its
//     constants, and the elements of a run that do not fill a whole vector take the
//     scalar sequence (identical arithmetic).
// Either way the column of an element depends on its index only, never on where a thread
// starts, so the thread-count independence below still holds.
//
// Work is split into fixed blocks of kBlockElems elements and the scalar tail uses the
// same operation sequence (std::fma) as the vector body, so every element is computed by
// the same instructions whatever the thread count: results are bit-identical for any
// num_threads. The caller may pass num_threads > 0 to bound the OpenMP team (the engine's
// background worker keeps to its share of the cores); 0 means the OpenMP default.
//
// The GIL: torch.ops calls from Python release it in the dispatcher path
// (invokeOperatorFromPython), so this kernel never touches Python state.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace zenflow {
namespace {

// 64K elements: a multiple of every vector width used (8 or 16 floats), large enough that
// the OpenMP scheduling cost (~1 us per block) is noise next to 64K * 28 bytes = 1.8 MB of
// memory traffic, small enough that 2**20 elements already give 16 blocks to share.
constexpr int64_t kBlockElems = int64_t{1} << 16;

// Columns per chunk of the per-column table build (see col_tables): 4096 columns are
// ~0.1 ms of pow calls, well above the cost of handing a chunk to a thread.
constexpr int64_t kTableChunk = 4096;

// Per-call constants, all fp32 except the flags; derived in double in adamw_step_.
struct StepConsts {
  float grad_scale;
  float decay;          // 1 - lr*wd (AdamW), 1 otherwise
  float l2;             // wd (classic Adam), 0 otherwise
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  bool decoupled;       // adamw_mode && wd != 0
  bool coupled;         // !adamw_mode && wd != 0
};

// The two constants that depend on the step count t: once per call, or once per column.
struct BiasConsts {
  float inv_bc2_sqrt;   // 1 / sqrt(1 - beta2^t)
  float neg_step_size;  // -lr / (1 - beta1^t)
};

// The only place these are derived (double, then one rounding to float), so a column whose
// step equals the scalar step gets exactly the scalar path's constants.
BiasConsts bias_consts(int64_t step, double lr, double beta1, double beta2) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  return {static_cast<float>(1.0 / std::sqrt(bias_correction2)),
          static_cast<float>(-lr / bias_correction1)};
}

inline float fused_mul_add(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

inline float load_grad_scalar(const float* g, int64_t i) { return g[i]; }

inline float load_grad_scalar(const c10::BFloat16* g, int64_t i) {
  uint16_t bits;
  std::memcpy(&bits, g + i, sizeof(bits));
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// One element; the operation sequence mirrors the vector bodies below exactly.
template <typename GradT>
inline void step_scalar(int64_t i, float* __restrict p, const GradT* __restrict g,
                        float* __restrict m, float* __restrict v, c10::BFloat16* __restrict pb,
                        const StepConsts& c, float inv_bc2_sqrt, float neg_step_size) {
  float grad = load_grad_scalar(g, i) * c.grad_scale;
  float param = p[i];
  if (c.decoupled) param = param * c.decay;
  if (c.coupled) grad = fused_mul_add(c.l2, param, grad);
  const float exp_avg = fused_mul_add(c.beta1, m[i], c.one_minus_beta1 * grad);
  const float exp_avg_sq = fused_mul_add(c.beta2, v[i], (c.one_minus_beta2 * grad) * grad);
  const float denom = fused_mul_add(std::sqrt(exp_avg_sq), inv_bc2_sqrt, c.eps);
  param = fused_mul_add(neg_step_size, exp_avg / denom, param);
  m[i] = exp_avg;
  v[i] = exp_avg_sq;
  p[i] = param;
  if (pb != nullptr) pb[i] = c10::BFloat16(param);  // round to nearest even, NaN -> 0x7FC0
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------- AVX-512: 16 floats
constexpr int64_t kWidth = 16;
using Vec = __m512;

inline Vec vec_set1(float x) { return _mm512_set1_ps(x); }
inline Vec vec_load(const float* x) { return _mm512_loadu_ps(x); }

inline __m512 load_grad_vec(const float* g, int64_t i) { return _mm512_loadu_ps(g + i); }

inline __m512 load_grad_vec(const c10::BFloat16* g, int64_t i) {
  // bf16 is the top half of an fp32: widen 16 x u16 to u32 and shift into place.
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline void store_bf16_vec(c10::BFloat16* dst, int64_t i, __m512 x) {
  // Same rounding as c10::BFloat16(float): add 0x7FFF + lsb, keep the top 16 bits; NaN
  // becomes the canonical 0x7FC0.
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_srli_epi32(rounded, 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_blend_epi32(is_nan, rounded, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(rounded));
}

template <typename GradT>
inline void step_vector(int64_t i, float* __restrict p, const GradT* __restrict g,
                        float* __restrict m, float* __restrict v, c10::BFloat16* __restrict pb,
                        const StepConsts& c, Vec inv_bc2_sqrt, Vec neg_step_size) {
  __m512 grad = _mm512_mul_ps(load_grad_vec(g, i), _mm512_set1_ps(c.grad_scale));
  __m512 param = _mm512_loadu_ps(p + i);
  if (c.decoupled) param = _mm512_mul_ps(param, _mm512_set1_ps(c.decay));
  if (c.coupled) grad = _mm512_fmadd_ps(_mm512_set1_ps(c.l2), param, grad);
  const __m512 exp_avg = _mm512_fmadd_ps(_mm512_set1_ps(c.beta1), _mm512_loadu_ps(m + i),
                                         _mm512_mul_ps(_mm512_set1_ps(c.one_minus_beta1), grad));
  const __m512 exp_avg_sq = _mm512_fmadd_ps(
      _mm512_set1_ps(c.beta2), _mm512_loadu_ps(v + i),
      _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(c.one_minus_beta2), grad), grad));
  // Moments are final here: store them before the long sqrt/div chain (frees the
  // registers and lets the stores drain while it runs).
  _mm512_storeu_ps(m + i, exp_avg);
  _mm512_storeu_ps(v + i, exp_avg_sq);
  const __m512 denom =
      _mm512_fmadd_ps(_mm512_sqrt_ps(exp_avg_sq), inv_bc2_sqrt, _mm512_set1_ps(c.eps));
  param = _mm512_fmadd_ps(neg_step_size, _mm512_div_ps(exp_avg, denom), param);
  _mm512_storeu_ps(p + i, param);
  if (pb != nullptr) store_bf16_vec(pb, i, param);
}

#elif defined(__AVX2__) && defined(__FMA__)
// ---------------------------------------------------------------- AVX2 + FMA: 8 floats
constexpr int64_t kWidth = 8;
using Vec = __m256;

inline Vec vec_set1(float x) { return _mm256_set1_ps(x); }
inline Vec vec_load(const float* x) { return _mm256_loadu_ps(x); }

inline __m256 load_grad_vec(const float* g, int64_t i) { return _mm256_loadu_ps(g + i); }

inline __m256 load_grad_vec(const c10::BFloat16* g, int64_t i) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline void store_bf16_vec(c10::BFloat16* dst, int64_t i, __m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  rounded = _mm256_srli_epi32(rounded, 16);
  const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(is_nan));
  // Values fit in 16 bits, so unsigned-saturating packing is exact. packus works per
  // 128-bit lane: qwords are [r0..r3, r0..r3, r4..r7, r4..r7]; keep qwords 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
}

template <typename GradT>
inline void step_vector(int64_t i, float* __restrict p, const GradT* __restrict g,
                        float* __restrict m, float* __restrict v, c10::BFloat16* __restrict pb,
                        const StepConsts& c, Vec inv_bc2_sqrt, Vec neg_step_size) {
  __m256 grad = _mm256_mul_ps(load_grad_vec(g, i), _mm256_set1_ps(c.grad_scale));
  __m256 param = _mm256_loadu_ps(p + i);
  if (c.decoupled) param = _mm256_mul_ps(param, _mm256_set1_ps(c.decay));
  if (c.coupled) grad = _mm256_fmadd_ps(_mm256_set1_ps(c.l2), param, grad);
  const __m256 exp_avg = _mm256_fmadd_ps(_mm256_set1_ps(c.beta1), _mm256_loadu_ps(m + i),
                                         _mm256_mul_ps(_mm256_set1_ps(c.one_minus_beta1), grad));
  const __m256 exp_avg_sq = _mm256_fmadd_ps(
      _mm256_set1_ps(c.beta2), _mm256_loadu_ps(v + i),
      _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(c.one_minus_beta2), grad), grad));
  // Moments are final here: store them before the long sqrt/div chain (frees the
  // registers and lets the stores drain while it runs).
  _mm256_storeu_ps(m + i, exp_avg);
  _mm256_storeu_ps(v + i, exp_avg_sq);
  const __m256 denom =
      _mm256_fmadd_ps(_mm256_sqrt_ps(exp_avg_sq), inv_bc2_sqrt, _mm256_set1_ps(c.eps));
  param = _mm256_fmadd_ps(neg_step_size, _mm256_div_ps(exp_avg, denom), param);
  _mm256_storeu_ps(p + i, param);
  if (pb != nullptr) store_bf16_vec(pb, i, param);
}

#else
// ---------------------------------------------------------------- scalar fallback
constexpr int64_t kWidth = 1;
using Vec = float;

inline Vec vec_set1(float x) { return x; }
inline Vec vec_load(const float* x) { return *x; }

template <typename GradT>
inline void step_vector(int64_t i, float* __restrict p, const GradT* __restrict g,
                        float* __restrict m, float* __restrict v, c10::BFloat16* __restrict pb,
                        const StepConsts& c, Vec inv_bc2_sqrt, Vec neg_step_size) {
  step_scalar(i, p, g, m, v, pb, c, inv_bc2_sqrt, neg_step_size);
}
#endif

static_assert(kBlockElems % kWidth == 0, "blocks must hold whole vectors");

// Per-column constants of one call: tables of C + kWidth floats, entry j holding column
// j % C (the first C entries are the columns, the last kWidth repeat the first ones).
struct ColTables {
  std::vector<float> inv_bc2_sqrt;
  std::vector<float> neg_step_size;
  int64_t num_cols;   // C
  int64_t col_inner;  // elements per run of one column
};

// One step-count for every element: the original loop.
template <typename GradT>
inline void run_range(int64_t begin, int64_t end, float* p, const GradT* g, float* m, float* v,
                      c10::BFloat16* pb, const StepConsts& c, BiasConsts b) {
  const Vec inv_bc2_sqrt = vec_set1(b.inv_bc2_sqrt);
  const Vec neg_step_size = vec_set1(b.neg_step_size);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth)
    step_vector(i, p, g, m, v, pb, c, inv_bc2_sqrt, neg_step_size);
  for (; i < end; ++i) step_scalar(i, p, g, m, v, pb, c, b.inv_bc2_sqrt, b.neg_step_size);
}

// col_inner == 1: element i is column i % C. `col` tracks the column of element i; a
// vector reads kWidth consecutive table entries from there (the wrap-around tail of the
// tables makes that valid for any col < C), then moves on by kWidth columns modulo C.
template <typename GradT>
inline void run_range_cols(int64_t begin, int64_t end, float* p, const GradT* g, float* m,
                           float* v, c10::BFloat16* pb, const StepConsts& c,
                           const ColTables& t) {
  const float* inv_bc2_sqrt = t.inv_bc2_sqrt.data();
  const float* neg_step_size = t.neg_step_size.data();
  const int64_t num_cols = t.num_cols;
  const int64_t advance = kWidth % num_cols;  // < C, so one conditional subtract wraps
  int64_t col = begin % num_cols;
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    step_vector(i, p, g, m, v, pb, c, vec_load(inv_bc2_sqrt + col),
                vec_load(neg_step_size + col));
    col += advance;
    if (col >= num_cols) col -= num_cols;
  }
  for (; i < end; ++i) {
    step_scalar(i, p, g, m, v, pb, c, inv_bc2_sqrt[col], neg_step_size[col]);
    if (++col == num_cols) col = 0;
  }
}

// col_inner > 1: element i is column (i / col_inner) % C, constant over runs of col_inner
// elements. Each run (clipped to the block) is a uniform range with its column's constants.
template <typename GradT>
inline void run_range_runs(int64_t begin, int64_t end, float* p, const GradT* g, float* m,
                           float* v, c10::BFloat16* pb, const StepConsts& c,
                           const ColTables& t) {
  const int64_t inner = t.col_inner;
  int64_t run = begin / inner;
  int64_t col = run % t.num_cols;
  int64_t i = begin;
  while (i < end) {
    const int64_t run_end = (run + 1) * inner < end ? (run + 1) * inner : end;
    const BiasConsts b{t.inv_bc2_sqrt[col], t.neg_step_size[col]};
    run_range(i, run_end, p, g, m, v, pb, c, b);
    i = run_end;
    ++run;
    if (++col == t.num_cols) col = 0;
  }
}

// cols == nullptr: the scalar step's constants `b` for every element.
template <typename GradT>
void run_blocks(int64_t numel, float* p, const GradT* g, float* m, float* v, c10::BFloat16* pb,
                const StepConsts& c, BiasConsts b, const ColTables* cols, int team) {
  const int64_t num_blocks = (numel + kBlockElems - 1) / kBlockElems;
  // A single block runs on the calling thread: no team start-up for small tensors. Blocks
  // are handed out dynamically so that a thread descheduled by a busy machine (the
  // training thread shares these cores) does not hold back a fixed half of the work; the
  // result is the same whichever thread takes a block.
#pragma omp parallel for schedule(dynamic, 1) num_threads(team) if (num_blocks > 1)
  for (int64_t block = 0; block < num_blocks; ++block) {
    const int64_t begin = block * kBlockElems;
    const int64_t end = begin + kBlockElems < numel ? begin + kBlockElems : numel;
    if (cols == nullptr) {
      run_range(begin, end, p, g, m, v, pb, c, b);
    } else if (cols->col_inner == 1) {
      run_range_cols(begin, end, p, g, m, v, pb, c, *cols);
    } else {
      run_range_runs(begin, end, p, g, m, v, pb, c, *cols);
    }
  }
}

constexpr const char* kOp = "zenflow::adamw_step_";

void check_cpu_contiguous(const at::Tensor& t, const char* name, at::ScalarType dtype,
                          int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), kOp, ": ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, kOp, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), kOp, ": ", name,
              " must be contiguous (the step writes in place; pass a contiguous tensor, "
              "not a view with strides ", t.strides(), ")");
  TORCH_CHECK(t.numel() == numel, kOp, ": ", name, " has ", t.numel(),
              " elements but param has ", numel);
}

// Checks col_steps against param's numel and builds the per-column tables (see ColTables).
ColTables col_tables(const at::Tensor& col_steps, int64_t col_inner, int64_t numel, double lr,
                     double beta1, double beta2, int team) {
  TORCH_CHECK(col_steps.device().is_cpu(), kOp, ": col_steps must be on the CPU, got ",
              col_steps.device());
  TORCH_CHECK(col_steps.scalar_type() == at::kLong, kOp, ": col_steps must be Long (int64), got ",
              col_steps.scalar_type());
  TORCH_CHECK(col_steps.dim() == 1, kOp, ": col_steps must be 1-D (one step per column), got ",
              col_steps.dim(), " dims");
  TORCH_CHECK(col_steps.is_contiguous(), kOp, ": col_steps must be contiguous, got strides ",
              col_steps.strides());
  const int64_t num_cols = col_steps.numel();
  TORCH_CHECK(num_cols >= 1, kOp, ": col_steps must have at least one column, got 0");
  // numel % (C * col_inner) == 0, written so that the product cannot overflow.
  TORCH_CHECK(numel % num_cols == 0 && (numel / num_cols) % col_inner == 0, kOp,
              ": param has ", numel, " elements, not a multiple of col_steps.numel() * "
              "col_inner = ", num_cols, " * ", col_inner);
  const int64_t* steps = col_steps.data_ptr<int64_t>();
  for (int64_t j = 0; j < num_cols; ++j) {
    TORCH_CHECK(steps[j] >= 1, kOp, ": col_steps must be >= 1 (1-based, for bias correction), "
                "got ", steps[j], " at column ", j);
  }
  ColTables t;
  t.num_cols = num_cols;
  t.col_inner = col_inner;
  t.inv_bc2_sqrt.resize(num_cols + kWidth);
  t.neg_step_size.resize(num_cols + kWidth);
  // Two pow calls per column cost ~25 ns: for a Conv1D weight with thousands of columns of
  // distinct counts that is ~0.1 ms, a few percent of a 4M-element step on one thread and
  // more on many, so chunks of columns are shared by the team. Within a chunk, a column
  // whose count equals its left neighbour's reuses its constants (columns moved in one
  // hand-over share a count). Every entry is a pure function of its count: the tables do
  // not depend on the team size.
  const int64_t num_chunks = (num_cols + kTableChunk - 1) / kTableChunk;
#pragma omp parallel for schedule(static) num_threads(team) if (num_chunks > 1)
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    const int64_t begin = chunk * kTableChunk;
    const int64_t end = begin + kTableChunk < num_cols ? begin + kTableChunk : num_cols;
    int64_t last_step = 0;
    BiasConsts last{};
    for (int64_t j = begin; j < end; ++j) {
      if (steps[j] != last_step) {
        last = bias_consts(steps[j], lr, beta1, beta2);
        last_step = steps[j];
      }
      t.inv_bc2_sqrt[j] = last.inv_bc2_sqrt;
      t.neg_step_size[j] = last.neg_step_size;
    }
  }
  for (int64_t j = num_cols; j < num_cols + kWidth; ++j) {
    t.inv_bc2_sqrt[j] = t.inv_bc2_sqrt[j % num_cols];
    t.neg_step_size[j] = t.neg_step_size[j % num_cols];
  }
  return t;
}

void adamw_step_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_bf16,
                 int64_t step, double lr, double beta1, double beta2, double eps,
                 double weight_decay, double grad_scale, bool adamw_mode, int64_t num_threads,
                 const std::optional<at::Tensor>& col_steps, int64_t col_inner) {
  const int64_t numel = param.numel();
  check_cpu_contiguous(param, "param", at::kFloat, numel);
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16, kOp,
              ": grad must be Float or BFloat16, got ", grad.scalar_type());
  check_cpu_contiguous(grad, "grad", grad.scalar_type(), numel);
  check_cpu_contiguous(exp_avg, "exp_avg", at::kFloat, numel);
  check_cpu_contiguous(exp_avg_sq, "exp_avg_sq", at::kFloat, numel);
  if (param_bf16.has_value()) check_cpu_contiguous(*param_bf16, "param_bf16", at::kBFloat16, numel);
  TORCH_CHECK(step >= 1, kOp, ": step must be >= 1 (1-based, for bias correction), got ", step);
  TORCH_CHECK(num_threads >= 0, kOp, ": num_threads must be >= 0 (0 = OpenMP default), got ",
              num_threads);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, kOp, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, kOp, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(col_inner >= 1, kOp,
              ": col_inner must be >= 1 (elements per run of one column), got ", col_inner);
  const int team = num_threads > 0 ? static_cast<int>(num_threads) : omp_get_max_threads();
  ColTables tables;
  if (col_steps.has_value()) {
    tables = col_tables(*col_steps, col_inner, numel, lr, beta1, beta2, team);
  }
  if (numel == 0) return;

  StepConsts c;
  c.grad_scale = static_cast<float>(grad_scale);
  c.decoupled = adamw_mode && weight_decay != 0.0;
  c.coupled = !adamw_mode && weight_decay != 0.0;
  c.decay = c.decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.l2 = c.coupled ? static_cast<float>(weight_decay) : 0.0f;
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  const BiasConsts b = bias_consts(step, lr, beta1, beta2);
  const ColTables* cols = col_steps.has_value() ? &tables : nullptr;

  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  c10::BFloat16* pb = param_bf16.has_value() ? param_bf16->data_ptr<c10::BFloat16>() : nullptr;
  if (grad.scalar_type() == at::kFloat) {
    run_blocks(numel, p, grad.data_ptr<float>(), m, v, pb, c, b, cols, team);
  } else {
    run_blocks(numel, p, grad.data_ptr<c10::BFloat16>(), m, v, pb, c, b, cols, team);
  }
}

// Which vector body this build compiled (the same macros that pick it above), so tests
// and `zfctl env` can say which path the element-wise checks exercised.
std::string simd_path() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY(zenflow, m) {
  m.def(
      "adamw_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? param_bf16, int step, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, float grad_scale, bool adamw_mode, int num_threads, "
      "Tensor? col_steps=None, int col_inner=1) -> ()");
  m.def("simd_path() -> str", &simd_path);
}

TORCH_LIBRARY_IMPL(zenflow, CPU, m) { m.impl("adamw_step_", &adamw_step_); }

}  // namespace zenflow
