// zenflow::adamw_q8_step_, zenflow::quantize_q8_, zenflow::dequantize_q8_ -- the compact
// host state's Adam moments in 8 bits, block-wise.
//
// In zfctl.host_state "compact" the host keeps, per weight, only the non-selected columns
// (the layout `W.index_select(column_dim, index)`, see host_ops.cpp): the fp32 master stays
// fp32, the window's gradient sum is bf16 (accumulate_ with a bf16 dst) and the two Adam
// moments are 8-bit codes with one fp32 scale per block of kQBlock = 256 elements of the
// flat tensor (the last block may be partial; a block's scale covers its elements only):
//
//   exp_avg m:              byte = sign << 7 | c, c in 0..127, e = c >> 3, f = c & 7
//   u = sqrt(exp_avg_sq):   byte = c, c in 0..255,             e = c >> 4, f = c & 15
//   value(c) = (e == 0) ? f / 2^k * 2^-14 : (1 + f / 2^k) * 2^(e-15)   (k = 3, resp. 4)
//   QMAX = value(largest code) = 1.875 (m), 1.9375 (u)
//
// Per block: scale = absmax / QMAX (fp32 division; absmax of |m|, resp. of u); an all-zero
// block has scale 0 and codes 0 (absmax > 0 gives scale > 0: QMAX < 2, so absmax / QMAX does
// not underflow). A value x gets the code whose value is nearest to q = |x| / scale (fp32
// division), ties to the even code, clamped to the largest code; it decodes to
// value(code) * scale (fp32), with the sign for m. Two choices the reference repeats:
//   - a negative m whose magnitude rounds to code 0 is stored as 0x00, never 0x80: zero
//     has one code, so equal states have equal bytes;
//   - a non-zero u never gets code 0 (it gets code 1): a zero second moment beside a
//     non-zero first moment would make the step m / eps.
// Why these formats: a float-like code keeps a relative precision over a wide range inside
// one block (the moments of 256 neighbours span decades), like bitsandbytes' and torchao's
// table-driven "dynamic" 8-bit map, but the nearest code is computable with integer and bit
// arithmetic (q8_codec.h), so the quantiser vectorises instead of searching a table per
// element. The relative error of a decoded value is at most 2^-(k+1) of it in the normal
// range (q >= 2^-14): 1/16 for m, 1/32 for u (so about 1/16 for v = u^2); u keeps one
// fraction bit more because it sits in the denominator of the step and has no sign bit.
//
// adamw_q8_step_(param, grad, m_codes, m_scales, u_codes, u_scales, image, step, ...,
// corr_*): one in-place Adam(W) step (corr_*: a q8 step store's last correction taken in as
// the step reads grad, as adamw_step_'s; adam_kernel.h). Per block: (1) decode m and
// v = u * u (fp32) into block-local buffers; (2) run the exact Adam element arithmetic of
// adamw_step_ (step_scalar / step_vector of adam_kernel.h, the same instructions: with
// exact moments the result equals adamw_step_'s) on param, those moments and the optional
// bf16 image, keeping u = sqrt(v_new) (the correctly rounded sqrt the step computes for its
// denominator);
// (3) requantise m and u with the block's new scales. Hyper-parameters, grad (fp32 or
// bf16, times grad_scale), image rounding and col_steps / col_inner (element i's column is
// (i / col_inner) % C, constants from bias_consts) are exactly those of adamw_step_.
//
// quantize_q8_(src, codes, scales, is_signed) / dequantize_q8_(codes, scales, dst,
// is_signed): a whole fp32 tensor into codes and scales and back, in the m format
// (is_signed) or the u format: the engine builds the compact state from fp32 moments, lays
// columns out again at re-selection and saves readable checkpoints with them.
//
// Threads: the work is split into blocks of kBlockElems elements (whole quantisation
// blocks) handed out dynamically; every element and every scale is computed by the same
// instructions whatever thread takes it, so the results do not depend on num_threads.
// Non-finite values: the engine never passes them (it skips a step whose gradient is not
// finite), and the codes of a non-finite value are not specified.

#include "q8_codec.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

namespace zenflow {
namespace {

constexpr const char* kQ8StepOp = "zenflow::adamw_q8_step_";
constexpr const char* kQuantizeOp = "zenflow::quantize_q8_";
constexpr const char* kDequantizeOp = "zenflow::dequantize_q8_";

int64_t num_qblocks(int64_t numel) { return (numel + kQBlock - 1) / kQBlock; }

void check_dense(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype,
                 int64_t numel, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name,
              " must be contiguous (the op writes in place; pass a contiguous tensor, not a "
              "view with strides ", t.strides(), ")");
  TORCH_CHECK(t.numel() == numel, op, ": ", name, " has ", t.numel(), " elements, expected ",
              numel, " (", what, ")");
}

void check_codes_scales(const char* op, const at::Tensor& codes, const at::Tensor& scales,
                        const char* codes_name, const char* scales_name, int64_t numel) {
  check_dense(codes, op, codes_name, at::kByte, numel, "one code per element");
  check_dense(scales, op, scales_name, at::kFloat, num_qblocks(numel),
              "one scale per 256-element block");
}

int team_size(const char* op, int64_t num_threads) {
  TORCH_CHECK(num_threads >= 0, op, ": num_threads must be >= 0 (0 = OpenMP default), got ",
              num_threads);
  return num_threads > 0 ? static_cast<int>(num_threads) : omp_get_max_threads();
}

// Calls body(begin, len) for every quantisation block, on the team, in blocks of
// kBlockElems elements.
template <typename Body>
void for_each_qblock(int64_t numel, int team, const Body& body) {
  const int64_t num_groups = (numel + kBlockElems - 1) / kBlockElems;
#pragma omp parallel for schedule(dynamic, 1) num_threads(team) if (num_groups > 1)
  for (int64_t group = 0; group < num_groups; ++group) {
    const int64_t end = (group + 1) * kBlockElems < numel ? (group + 1) * kBlockElems : numel;
    for (int64_t begin = group * kBlockElems; begin < end; begin += kQBlock) {
      body(begin, end - begin < kQBlock ? end - begin : kQBlock);
    }
  }
}

struct Q8Moments {
  uint8_t* m_codes;
  float* m_scales;
  uint8_t* u_codes;
  float* u_scales;
};

// One quantisation block [begin, begin + len): decode, Adam, requantise. With a q8 step
// store's correction (adam_kernel.h, Correction) the step reads the block's corrected sum,
// made in a buffer on the stack segment by segment (a piece's 256-blocks need not line up
// with the moments').
template <typename GradT>
inline void q8_block(int64_t begin, int64_t len, float* p, const GradT* g, const Q8Moments& q,
                     c10::BFloat16* pb, const StepConsts& c, BiasConsts b,
                     const ColTables* cols, const Correction* corr) {
  alignas(64) float m[kQBlock];
  alignas(64) float v[kQBlock];  // v = u^2 in, u = sqrt(v_new) out (kSqrtOut)
  const int64_t block = begin / kQBlock;
  dequantize_block<FormatM, false>(q.m_codes + begin, q.m_scales[block], len, m);
  dequantize_block<FormatU, true>(q.u_codes + begin, q.u_scales[block], len, v);
  float* pp = p + begin;
  c10::BFloat16* pbb = pb == nullptr ? nullptr : pb + begin;
  if (corr == nullptr) {
    run_span<GradT, true>(0, len, pp, g + begin, m, v, pbb, c, b, cols, begin);
  } else {
    alignas(64) float tmp[kQBlock];
    for_each_corr_segment(*corr, begin, begin + len, [&](int64_t a, int64_t n, float scale) {
      corrected_grad(tmp + (a - begin), g, corr->codes, scale, corr->delta, a, n);
    });
    run_span<float, true>(0, len, pp, tmp, m, v, pbb, c, b, cols, begin);
  }
  q.m_scales[block] = quantize_block<FormatM>(m, len, q.m_codes + begin);
  q.u_scales[block] = quantize_block<FormatU>(v, len, q.u_codes + begin);
}

template <typename GradT>
void q8_step(int64_t numel, float* p, const GradT* g, const Q8Moments& q, c10::BFloat16* pb,
             const StepConsts& c, BiasConsts b, const ColTables* cols, const Correction* corr,
             int team) {
  for_each_qblock(numel, team, [&](int64_t begin, int64_t len) {
    q8_block(begin, len, p, g, q, pb, c, b, cols, corr);
  });
}

void adamw_q8_step_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m_codes,
                    const at::Tensor& m_scales, const at::Tensor& u_codes,
                    const at::Tensor& u_scales, const std::optional<at::Tensor>& image,
                    int64_t step, double lr, double beta1, double beta2, double eps,
                    double weight_decay, double grad_scale, bool adamw_mode,
                    int64_t num_threads, const std::optional<at::Tensor>& col_steps,
                    int64_t col_inner, const std::optional<at::Tensor>& corr_codes,
                    const std::optional<at::Tensor>& corr_scales,
                    const std::optional<at::Tensor>& corr_starts, double corr_delta) {
  const char* op = kQ8StepOp;
  const int64_t numel = param.numel();
  check_dense(param, op, "param", at::kFloat, numel, "the param's");
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16, op,
              ": grad must be Float or BFloat16, got ", grad.scalar_type());
  check_dense(grad, op, "grad", grad.scalar_type(), numel, "one per param element");
  check_codes_scales(op, m_codes, m_scales, "m_codes", "m_scales", numel);
  check_codes_scales(op, u_codes, u_scales, "u_codes", "u_scales", numel);
  if (image.has_value()) {
    check_dense(*image, op, "image", at::kBFloat16, numel, "one per param element");
  }
  TORCH_CHECK(step >= 1, op, ": step must be >= 1 (1-based, for bias correction), got ", step);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, op, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, op, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(col_inner >= 1, op,
              ": col_inner must be >= 1 (elements per run of one column), got ", col_inner);
  const int team = team_size(op, num_threads);
  ColTables tables;
  if (col_steps.has_value()) {
    tables = col_tables(op, *col_steps, col_inner, numel, lr, beta1, beta2, team);
  }
  Correction corr_data{};
  const Correction* corr =
      read_correction(op, corr_codes, corr_scales, corr_starts, corr_delta, numel, corr_data)
          ? &corr_data
          : nullptr;
  if (numel == 0) return;

  const StepConsts c =
      make_step_consts(lr, beta1, beta2, eps, weight_decay, grad_scale, adamw_mode);
  const BiasConsts b = bias_consts(step, lr, beta1, beta2);
  const ColTables* cols = col_steps.has_value() ? &tables : nullptr;
  const Q8Moments q{m_codes.data_ptr<uint8_t>(), m_scales.data_ptr<float>(),
                    u_codes.data_ptr<uint8_t>(), u_scales.data_ptr<float>()};
  float* p = param.data_ptr<float>();
  c10::BFloat16* pb = image.has_value() ? image->data_ptr<c10::BFloat16>() : nullptr;
  if (grad.scalar_type() == at::kFloat) {
    q8_step(numel, p, grad.data_ptr<float>(), q, pb, c, b, cols, corr, team);
  } else {
    q8_step(numel, p, grad.data_ptr<c10::BFloat16>(), q, pb, c, b, cols, corr, team);
  }
}

void quantize_q8_(const at::Tensor& src, const at::Tensor& codes, const at::Tensor& scales,
                  bool is_signed, int64_t num_threads) {
  const int64_t numel = src.numel();
  check_dense(src, kQuantizeOp, "src", at::kFloat, numel, "the source's");
  check_codes_scales(kQuantizeOp, codes, scales, "codes", "scales", numel);
  const int team = team_size(kQuantizeOp, num_threads);
  const float* x = src.data_ptr<float>();
  uint8_t* c = codes.data_ptr<uint8_t>();
  float* s = scales.data_ptr<float>();
  for_each_qblock(numel, team, [&](int64_t begin, int64_t len) {
    s[begin / kQBlock] = is_signed ? quantize_block<FormatM>(x + begin, len, c + begin)
                                   : quantize_block<FormatU>(x + begin, len, c + begin);
  });
}

void dequantize_q8_(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& dst,
                    bool is_signed, int64_t num_threads) {
  const int64_t numel = dst.numel();
  check_dense(dst, kDequantizeOp, "dst", at::kFloat, numel, "the destination's");
  check_codes_scales(kDequantizeOp, codes, scales, "codes", "scales", numel);
  const int team = team_size(kDequantizeOp, num_threads);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  float* out = dst.data_ptr<float>();
  for_each_qblock(numel, team, [&](int64_t begin, int64_t len) {
    const float scale = s[begin / kQBlock];
    if (is_signed) {
      dequantize_block<FormatM, false>(c + begin, scale, len, out + begin);
    } else {
      dequantize_block<FormatU, false>(c + begin, scale, len, out + begin);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zenflow, CPU, m) {
  m.impl("adamw_q8_step_", &adamw_q8_step_);
  m.impl("quantize_q8_", &quantize_q8_);
  m.impl("dequantize_q8_", &dequantize_q8_);
}

}  // namespace zenflow
