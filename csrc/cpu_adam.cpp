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

#include "adam_kernel.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <string>

namespace zenflow {
namespace {

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
    run_span(begin, end, p, g, m, v, pb, c, b, cols);
  }
}

// run_blocks with a q8 correction (adam_kernel.h, Correction): each 64K block split where a
// piece or one of its 256-blocks ends; each segment's corrected sum in a buffer on the
// stack, then the step over the segment (flat0: its place, for the per-column constants).
void run_blocks_corrected(int64_t numel, float* p, const float* g, float* m, float* v,
                          c10::BFloat16* pb, const StepConsts& c, BiasConsts b,
                          const ColTables* cols, const Correction& corr, int team) {
  const int64_t num_blocks = (numel + kBlockElems - 1) / kBlockElems;
#pragma omp parallel for schedule(dynamic, 1) num_threads(team) if (num_blocks > 1)
  for (int64_t block = 0; block < num_blocks; ++block) {
    const int64_t begin = block * kBlockElems;
    const int64_t end = begin + kBlockElems < numel ? begin + kBlockElems : numel;
    float tmp[kI8Block];
    for_each_corr_segment(corr, begin, end, [&](int64_t a, int64_t n, float scale) {
      corrected_grad(tmp, g, corr.codes, scale, corr.delta, a, n);
      c10::BFloat16* pba = pb != nullptr ? pb + a : nullptr;
      run_span(0, n, p + a, tmp, m + a, v + a, pba, c, b, cols, a);
    });
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

void adamw_step_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_bf16,
                 int64_t step, double lr, double beta1, double beta2, double eps,
                 double weight_decay, double grad_scale, bool adamw_mode, int64_t num_threads,
                 const std::optional<at::Tensor>& col_steps, int64_t col_inner,
                 const std::optional<at::Tensor>& corr_codes,
                 const std::optional<at::Tensor>& corr_scales,
                 const std::optional<at::Tensor>& corr_starts, double corr_delta) {
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
    tables = col_tables(kOp, *col_steps, col_inner, numel, lr, beta1, beta2, team);
  }
  Correction corr{};
  const bool corrected =
      read_correction(kOp, corr_codes, corr_scales, corr_starts, corr_delta, numel, corr);
  TORCH_CHECK(!corrected || grad.scalar_type() == at::kFloat, kOp,
              ": a correction needs an fp32 grad (the exact window sum), got ",
              grad.scalar_type());
  if (numel == 0) return;

  const StepConsts c =
      make_step_consts(lr, beta1, beta2, eps, weight_decay, grad_scale, adamw_mode);
  const BiasConsts b = bias_consts(step, lr, beta1, beta2);
  const ColTables* cols = col_steps.has_value() ? &tables : nullptr;

  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  c10::BFloat16* pb = param_bf16.has_value() ? param_bf16->data_ptr<c10::BFloat16>() : nullptr;
  if (corrected) {
    run_blocks_corrected(numel, p, grad.data_ptr<float>(), m, v, pb, c, b, cols, corr, team);
  } else if (grad.scalar_type() == at::kFloat) {
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
      "Tensor? col_steps=None, int col_inner=1, Tensor? corr_codes=None, "
      "Tensor? corr_scales=None, Tensor? corr_starts=None, float corr_delta=0.0) -> ()");
  m.def(
      "adamw_compact_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, "
      "Tensor(c!) exp_avg_sq, Tensor index, int column_dim, Tensor(d!)? image, int step, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, "
      "bool adamw_mode, int num_threads, Tensor? col_steps=None) -> ()");
  m.def(
      "accumulate_(Tensor(a!) dst, Tensor src, float scale, bool overwrite, bool sumsq, "
      "int num_threads) -> float");
  m.def(
      "accumulate_keep_i8_(Tensor(a!) dst, Tensor src, float scale, Tensor(b!) codes, "
      "Tensor(c!) scales, int num_threads, float prev_mul=1.0, float prev_delta=0.0) -> ()");
  m.def(
      "add_dequantized_i8_(Tensor(a!) dst, Tensor codes, Tensor scales, float scale, "
      "int num_threads) -> ()");
  m.def(
      "compact_merge_(Tensor(a!) data, Tensor drop, Tensor insert_at, Tensor values, "
      "int column_dim, int num_threads) -> ()");
  m.def(
      "gather_columns_(Tensor(a!) out, Tensor src, Tensor index, int dim, int num_threads) "
      "-> ()");
  // q8_ops.cpp: the compact host state's 8-bit moments.
  m.def(
      "adamw_q8_step_(Tensor(a!) param, Tensor grad, Tensor(b!) m_codes, Tensor(c!) m_scales, "
      "Tensor(d!) u_codes, Tensor(e!) u_scales, Tensor(f!)? image, int step, float lr, "
      "float beta1, float beta2, float eps, float weight_decay, float grad_scale, "
      "bool adamw_mode, int num_threads, Tensor? col_steps=None, int col_inner=1, "
      "Tensor? corr_codes=None, Tensor? corr_scales=None, Tensor? corr_starts=None, "
      "float corr_delta=0.0) -> ()");
  m.def(
      "quantize_q8_(Tensor src, Tensor(a!) codes, Tensor(b!) scales, bool is_signed, "
      "int num_threads) -> ()");
  m.def(
      "dequantize_q8_(Tensor codes, Tensor scales, Tensor(a!) dst, bool is_signed, "
      "int num_threads) -> ()");
  m.def("simd_path() -> str", &simd_path);
}

TORCH_LIBRARY_IMPL(zenflow, CPU, m) { m.impl("adamw_step_", &adamw_step_); }

}  // namespace zenflow
