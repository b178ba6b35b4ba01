// Shared inline kernel bodies of the native host ops (cpu_adam.cpp: adamw_step_;
// host_ops.cpp: adamw_compact_step_, accumulate_; q8_ops.cpp: adamw_q8_step_). The
// arithmetic, the vector bodies and their bit-exactness rules are described at the top of
// cpu_adam.cpp; every op that updates Adam state goes through step_scalar / step_vector, so
// all of them compute an element with the same instructions.
//
// kSqrtOut (template flag of the step bodies and loops, default false): store
// sqrt(exp_avg_sq) into v instead of exp_avg_sq. The sqrt is the one the step computes for
// its denominator anyway, so param, exp_avg and the bf16 image are the same instructions
// either way; adamw_q8_step_ keeps the second moment as u = sqrt(v) and uses it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
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
template <typename GradT, bool kSqrtOut = false>
inline void step_scalar(int64_t i, float* __restrict p, const GradT* __restrict g,
                        float* __restrict m, float* __restrict v, c10::BFloat16* __restrict pb,
                        const StepConsts& c, float inv_bc2_sqrt, float neg_step_size) {
  float grad = load_grad_scalar(g, i) * c.grad_scale;
  float param = p[i];
  if (c.decoupled) param = param * c.decay;
  if (c.coupled) grad = fused_mul_add(c.l2, param, grad);
  const float exp_avg = fused_mul_add(c.beta1, m[i], c.one_minus_beta1 * grad);
  const float exp_avg_sq = fused_mul_add(c.beta2, v[i], (c.one_minus_beta2 * grad) * grad);
  const float root = std::sqrt(exp_avg_sq);
  const float denom = fused_mul_add(root, inv_bc2_sqrt, c.eps);
  param = fused_mul_add(neg_step_size, exp_avg / denom, param);
  m[i] = exp_avg;
  v[i] = kSqrtOut ? root : exp_avg_sq;
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

template <typename GradT, bool kSqrtOut = false>
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
  if (!kSqrtOut) _mm512_storeu_ps(v + i, exp_avg_sq);
  const __m512 root = _mm512_sqrt_ps(exp_avg_sq);
  if (kSqrtOut) _mm512_storeu_ps(v + i, root);
  const __m512 denom = _mm512_fmadd_ps(root, inv_bc2_sqrt, _mm512_set1_ps(c.eps));
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

template <typename GradT, bool kSqrtOut = false>
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
  if (!kSqrtOut) _mm256_storeu_ps(v + i, exp_avg_sq);
  const __m256 root = _mm256_sqrt_ps(exp_avg_sq);
  if (kSqrtOut) _mm256_storeu_ps(v + i, root);
  const __m256 denom = _mm256_fmadd_ps(root, inv_bc2_sqrt, _mm256_set1_ps(c.eps));
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

template <typename GradT, bool kSqrtOut = false>
inline void step_vector(int64_t i, float* __restrict p, const GradT* __restrict g,
                        float* __restrict m, float* __restrict v, c10::BFloat16* __restrict pb,
                        const StepConsts& c, Vec inv_bc2_sqrt, Vec neg_step_size) {
  step_scalar<GradT, kSqrtOut>(i, p, g, m, v, pb, c, inv_bc2_sqrt, neg_step_size);
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

// The loops below take element indices [begin, end) of the pointers they are given. The
// column helpers also take flat0, the flat index (in the whole tensor) of pointer element
// 0: element i belongs to column ((flat0 + i) / col_inner) % C. adamw_step_ passes the
// whole tensor (flat0 = 0); adamw_q8_step_ passes one quantisation block at a time, with
// its moments in block-local buffers.

// One step-count for every element: the original loop.
template <typename GradT, bool kSqrtOut = false>
inline void run_range(int64_t begin, int64_t end, float* p, const GradT* g, float* m, float* v,
                      c10::BFloat16* pb, const StepConsts& c, BiasConsts b) {
  const Vec inv_bc2_sqrt = vec_set1(b.inv_bc2_sqrt);
  const Vec neg_step_size = vec_set1(b.neg_step_size);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth)
    step_vector<GradT, kSqrtOut>(i, p, g, m, v, pb, c, inv_bc2_sqrt, neg_step_size);
  for (; i < end; ++i)
    step_scalar<GradT, kSqrtOut>(i, p, g, m, v, pb, c, b.inv_bc2_sqrt, b.neg_step_size);
}

// col_inner == 1: element i is column (flat0 + i) % C. `col` tracks the column of element
// i; a vector reads kWidth consecutive table entries from there (the wrap-around tail of
// the tables makes that valid for any col < C), then moves on by kWidth columns modulo C.
template <typename GradT, bool kSqrtOut = false>
inline void run_range_cols(int64_t begin, int64_t end, float* p, const GradT* g, float* m,
                           float* v, c10::BFloat16* pb, const StepConsts& c,
                           const ColTables& t, int64_t flat0 = 0) {
  const float* inv_bc2_sqrt = t.inv_bc2_sqrt.data();
  const float* neg_step_size = t.neg_step_size.data();
  const int64_t num_cols = t.num_cols;
  const int64_t advance = kWidth % num_cols;  // < C, so one conditional subtract wraps
  int64_t col = (flat0 + begin) % num_cols;
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    step_vector<GradT, kSqrtOut>(i, p, g, m, v, pb, c, vec_load(inv_bc2_sqrt + col),
                                 vec_load(neg_step_size + col));
    col += advance;
    if (col >= num_cols) col -= num_cols;
  }
  for (; i < end; ++i) {
    step_scalar<GradT, kSqrtOut>(i, p, g, m, v, pb, c, inv_bc2_sqrt[col], neg_step_size[col]);
    if (++col == num_cols) col = 0;
  }
}

// col_inner > 1: element i is column ((flat0 + i) / col_inner) % C, constant over runs of
// col_inner elements. Each run (clipped to [begin, end)) is a uniform range with its
// column's constants.
template <typename GradT, bool kSqrtOut = false>
inline void run_range_runs(int64_t begin, int64_t end, float* p, const GradT* g, float* m,
                           float* v, c10::BFloat16* pb, const StepConsts& c,
                           const ColTables& t, int64_t flat0 = 0) {
  const int64_t inner = t.col_inner;
  int64_t run = (flat0 + begin) / inner;
  int64_t col = run % t.num_cols;
  int64_t i = begin;
  while (i < end) {
    const int64_t next = (run + 1) * inner - flat0;  // local index of the next run's start
    const int64_t run_end = next < end ? next : end;
    const BiasConsts b{t.inv_bc2_sqrt[col], t.neg_step_size[col]};
    run_range<GradT, kSqrtOut>(i, run_end, p, g, m, v, pb, c, b);
    i = run_end;
    ++run;
    if (++col == t.num_cols) col = 0;
  }
}


// The step over [begin, end) of the pointers given, with the constants of one step count
// (cols null), of a column per element (col_inner 1) or of runs of one column; flat0: the
// place of pointer element 0 in the whole tensor (for the columns).
template <typename GradT, bool kSqrtOut = false>
inline void run_span(int64_t begin, int64_t end, float* p, const GradT* g, float* m, float* v,
                     c10::BFloat16* pb, const StepConsts& c, BiasConsts b,
                     const ColTables* cols, int64_t flat0 = 0) {
  if (cols == nullptr) {
    run_range<GradT, kSqrtOut>(begin, end, p, g, m, v, pb, c, b);
  } else if (cols->col_inner == 1) {
    run_range_cols<GradT, kSqrtOut>(begin, end, p, g, m, v, pb, c, *cols, flat0);
  } else {
    run_range_runs<GradT, kSqrtOut>(begin, end, p, g, m, v, pb, c, *cols, flat0);
  }
}

// Checks col_steps against param's numel and builds the per-column tables (see ColTables);
// error messages start with the calling op's name `op`.
inline ColTables col_tables(const char* op, const at::Tensor& col_steps, int64_t col_inner,
                            int64_t numel, double lr, double beta1, double beta2, int team) {
  TORCH_CHECK(col_steps.device().is_cpu(), op, ": col_steps must be on the CPU, got ",
              col_steps.device());
  TORCH_CHECK(col_steps.scalar_type() == at::kLong, op, ": col_steps must be Long (int64), got ",
              col_steps.scalar_type());
  TORCH_CHECK(col_steps.dim() == 1, op, ": col_steps must be 1-D (one step per column), got ",
              col_steps.dim(), " dims");
  TORCH_CHECK(col_steps.is_contiguous(), op, ": col_steps must be contiguous, got strides ",
              col_steps.strides());
  const int64_t num_cols = col_steps.numel();
  TORCH_CHECK(num_cols >= 1, op, ": col_steps must have at least one column, got 0");
  // numel % (C * col_inner) == 0, written so that the product cannot overflow.
  TORCH_CHECK(numel % num_cols == 0 && (numel / num_cols) % col_inner == 0, op,
              ": param has ", numel, " elements, not a multiple of col_steps.numel() * "
              "col_inner = ", num_cols, " * ", col_inner);
  const int64_t* steps = col_steps.data_ptr<int64_t>();
  for (int64_t j = 0; j < num_cols; ++j) {
    TORCH_CHECK(steps[j] >= 1, op, ": col_steps must be >= 1 (1-based, for bias correction), "
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

// zfctl.step_store "q8": a window's last correction taken in as a step reads the window sum
// (adamw_step_ and adamw_q8_step_'s corr_* arguments). The sum the step reads is
// sum + delta * (code * scale) of the pieces' 8-bit copy, each product and sum rounded to
// fp32 in that order and stored in the sum's dtype, exactly as add_dequantized_i8_ would
// store it before the step (host_ops.cpp; a block of kI8Block elements shares a scale, and
// each piece's blocks start at its first element): the same step, bit for bit, without the
// pass over the sum. The sum itself is left as it was.
constexpr int64_t kI8Block = 256;  // elements per scale of an 8-bit copy (host_ops.cpp)

struct Correction {
  const int8_t* codes;    // one per element
  const float* scales;    // one per block, piece after piece
  const int64_t* starts;  // the pieces' first elements, then numel
  std::vector<int64_t> first_scale;  // each piece's first block in scales
  int64_t pieces;
  float delta;
};

// The correction's tensors, checked (error messages start with `op`): all three or none
// (false); codes int8 [numel]; starts int64 [P + 1], 0 first, numel last, increasing;
// scales fp32, one per 256-block of each piece.
inline bool read_correction(const char* op, const std::optional<at::Tensor>& codes,
                            const std::optional<at::Tensor>& scales,
                            const std::optional<at::Tensor>& starts, double delta,
                            int64_t numel, Correction& corr) {
  if (!codes.has_value() && !scales.has_value() && !starts.has_value()) return false;
  TORCH_CHECK(codes.has_value() && scales.has_value() && starts.has_value(), op,
              ": corr_codes, corr_scales and corr_starts go together (all three or none)");
  for (const at::Tensor* t : {&*codes, &*scales, &*starts}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->dim() == 1, op,
                ": corr_codes, corr_scales and corr_starts must be 1-D, contiguous, on the CPU");
  }
  TORCH_CHECK(codes->scalar_type() == at::kChar && codes->numel() == numel, op,
              ": corr_codes must be Char (int8) with one per element (", numel, "), got ",
              codes->scalar_type(), " x ", codes->numel());
  TORCH_CHECK(scales->scalar_type() == at::kFloat, op, ": corr_scales must be Float");
  TORCH_CHECK(starts->scalar_type() == at::kLong && starts->numel() >= 2, op,
              ": corr_starts must be Long (int64) with the pieces' starts and numel last");
  corr.codes = codes->data_ptr<int8_t>();
  corr.scales = scales->data_ptr<float>();
  corr.starts = starts->data_ptr<int64_t>();
  corr.pieces = starts->numel() - 1;
  corr.delta = static_cast<float>(delta);
  TORCH_CHECK(corr.starts[0] == 0 && corr.starts[corr.pieces] == numel, op,
              ": corr_starts must begin at 0 and end at numel (", numel, ")");
  corr.first_scale.resize(corr.pieces);
  int64_t blocks = 0;
  for (int64_t q = 0; q < corr.pieces; ++q) {
    const int64_t len = corr.starts[q + 1] - corr.starts[q];
    TORCH_CHECK(len > 0, op, ": corr_starts must increase, got ", corr.starts[q], " then ",
                corr.starts[q + 1], " at piece ", q);
    corr.first_scale[q] = blocks;
    blocks += (len + kI8Block - 1) / kI8Block;
  }
  TORCH_CHECK(scales->numel() == blocks, op, ": corr_scales has ", scales->numel(),
              " elements, expected one per 256-element block of each piece: ", blocks);
  return true;
}

// Calls fn(a, n, scale) for each segment [a, a + n) of [begin, end) inside one piece's
// 256-block, in order, with that block's scale.
template <typename Fn>
inline void for_each_corr_segment(const Correction& corr, int64_t begin, int64_t end,
                                  const Fn& fn) {
  int64_t piece =
      std::upper_bound(corr.starts, corr.starts + corr.pieces, begin) - corr.starts - 1;
  for (int64_t a = begin; a < end;) {
    while (a >= corr.starts[piece + 1]) ++piece;
    const int64_t blk = (a - corr.starts[piece]) / kI8Block;
    int64_t stop = corr.starts[piece] + (blk + 1) * kI8Block;
    stop = stop < corr.starts[piece + 1] ? stop : corr.starts[piece + 1];
    stop = stop < end ? stop : end;
    fn(a, stop - a, corr.scales[corr.first_scale[piece] + blk]);
    a = stop;
  }
}

// The sum's dtype's rounding of a corrected value, as the pass stores it: none for fp32,
// round to nearest even for bf16 as c10::BFloat16(float) and host_ops.cpp's store_float do
// (add 0x7FFF + lsb, keep the top half; NaN becomes 0x7FC0), in integer operations only so
// that the loop vectorises.
inline float corr_round(float x, const float*) { return x; }
inline float corr_round(float x, const c10::BFloat16*) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  uint32_t top = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  top = (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : top;
  const uint32_t wide = top << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// tmp[k] = round(g[a + k] + delta * (codes[a + k] * s)), k < n: fp-contract=off, as the
// pass (AddI8Block in host_ops.cpp).
template <typename GradT>
__attribute__((optimize("fp-contract=off"))) inline void corrected_grad(
    float* tmp, const GradT* g, const int8_t* codes, float s, float delta, int64_t a,
    int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const float value = static_cast<float>(codes[a + k]) * s;
    const float prod = delta * value;
    tmp[k] = corr_round(load_grad_scalar(g, a + k) + prod, g);
  }
}

// The per-call constants of one step, derived in double once (shared by every op).
inline StepConsts make_step_consts(double lr, double beta1, double beta2, double eps,
                                   double weight_decay, double grad_scale, bool adamw_mode) {
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
  return c;
}

}  // namespace
}  // namespace zenflow
