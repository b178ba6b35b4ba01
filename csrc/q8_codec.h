// The block-wise 8-bit codes of the compact host state's Adam moments: the two code
// formats, their scalar and SIMD encoders and decoders, and the per-block quantise /
// dequantise loops that q8_ops.cpp runs. The formats, the rounding rule and why they were
// chosen are described at the top of q8_ops.cpp; zenflow/ops/q8_reference.py is the plain
// definition these bit tricks must equal.
//
// A code is a tiny float with a 4-bit exponent field e (bias 15) and a kMantBits-bit
// fraction f: value = (e == 0) ? f / 2^kMantBits * 2^-14 : (1 + f / 2^kMantBits) * 2^(e-15).
// Its bits (e << kMantBits | f) are then an fp32's exponent and top fraction bits shifted
// down, less the bias difference 127 - 15 = 112, which is what both directions use:
//   encode (q >= 2^-14): round the fp32 q to kMantBits fraction bits, nearest-even, by
//     adding 2^(shift-1) - 1 + lsb to its bits (a carry out of the fraction lands in the
//     exponent, exactly as rounding up to the next binade should), then
//     code = (bits >> shift) - (112 << kMantBits), shift = 23 - kMantBits;
//   encode (q < 2^-14, e == 0): the codes are f = q * 2^(14 + kMantBits), rounded to the
//     nearest integer, ties to even (code 2^kMantBits is 2^-14 itself, the first e == 1
//     code, so this range hands over to the other seamlessly);
//   decode: the inverse; codes below 2^kMantBits as the exact product f * 2^-(14+kMantBits).
// Every operation is exact or correctly rounded, so the scalar, AVX2 and AVX-512 bodies give
// the same bits and any mixture of them (vector body, scalar tail) is safe.
#pragma once

#include "adam_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace zenflow {
namespace {

// Elements per quantisation block: one fp32 scale per 256 codes is 1/64 byte per element of
// overhead, and a block's two fp32 moment buffers (2 KB) stay in L1 between the dequantise,
// Adam and requantise passes. A divisor of kBlockElems, so the thread blocks hold whole
// quantisation blocks and the scales do not depend on the thread count.
constexpr int64_t kQBlock = 256;
static_assert(kBlockElems % kQBlock == 0, "thread blocks must hold whole quantisation blocks");
static_assert(kQBlock % kWidth == 0, "quantisation blocks must hold whole vectors");

// exp_avg: sign bit + 7-bit magnitude code (e = c >> 3, f = c & 7), largest value 1.875.
struct FormatM {
  static constexpr int kMantBits = 3;
  static constexpr uint32_t kMaxCode = 127;
  static constexpr float kQMax = 1.875f;
  static constexpr float kSubScale = 131072.0f;  // 2^17: q * 2^17 = f for the e == 0 codes
  static constexpr bool kSigned = true;
};

// u = sqrt(exp_avg_sq): unsigned 8-bit code (e = c >> 4, f = c & 15), largest value 1.9375.
struct FormatU {
  static constexpr int kMantBits = 4;
  static constexpr uint32_t kMaxCode = 255;
  static constexpr float kQMax = 1.9375f;
  static constexpr float kSubScale = 262144.0f;  // 2^18
  static constexpr bool kSigned = false;
};

constexpr float kMinNormalCode = 0x1p-14f;  // value of the code e = 1, f = 0
constexpr uint32_t kBiasShift = 112;        // fp32 exponent bias 127 - code bias 15

inline uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

inline float bits_float(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// Magnitude code of q = |x| / scale >= 0 (finite): nearest table value, ties to the even
// code, clamped to the largest code.
template <class F>
inline uint32_t encode_magnitude(float q) {
  if (q < kMinNormalCode) return static_cast<uint32_t>(std::nearbyint(q * F::kSubScale));
  constexpr int kShift = 23 - F::kMantBits;
  const uint32_t bits = float_bits(q);
  const uint32_t rounded = bits + ((1u << (kShift - 1)) - 1) + ((bits >> kShift) & 1u);
  const uint32_t code = (rounded >> kShift) - (kBiasShift << F::kMantBits);
  return code < F::kMaxCode ? code : F::kMaxCode;
}

// The byte of x in a block of scale > 0. m: a negative x whose magnitude rounds to code 0
// gets 0x00, never 0x80 (one code for zero). u: the sign of x is dropped (the engine passes
// square roots), and a non-zero |x| never gets code 0.
template <class F>
inline uint8_t encode_scalar(float x, float scale) {
  const float mag = std::fabs(x);
  uint32_t code = encode_magnitude<F>(mag / scale);
  if constexpr (F::kSigned) {
    if (code != 0 && x < 0.0f) code |= 0x80u;
  } else {
    if (code == 0 && mag > 0.0f) code = 1;
  }
  return static_cast<uint8_t>(code);
}

template <class F>
inline float decode_magnitude(uint32_t c) {
  if (c < (1u << F::kMantBits)) return static_cast<float>(c) * (1.0f / F::kSubScale);
  return bits_float((c + (kBiasShift << F::kMantBits)) << (23 - F::kMantBits));
}

// value(code) * scale, the sign applied (m); squared when kSquare (u -> v = u * u).
template <class F, bool kSquare>
inline float decode_scalar(uint8_t code, float scale) {
  const uint32_t c = code;
  float value = decode_magnitude<F>(F::kSigned ? (c & 0x7Fu) : c) * scale;
  if (F::kSigned && (c & 0x80u)) value = -value;
  return kSquare ? value * value : value;
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------- AVX-512: 16 codes
#define ZENFLOW_Q8_VECTOR 1
using VecI = __m512i;

inline __m512 vec_abs(__m512 x) { return _mm512_abs_ps(x); }
inline __m512 vec_max(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
inline float vec_reduce_max(__m512 x) { return _mm512_reduce_max_ps(x); }
inline void vec_store(float* dst, __m512 x) { _mm512_storeu_ps(dst, x); }

template <class F>
inline __m512i encode_vec(__m512 x, __m512 scale) {
  constexpr int kShift = 23 - F::kMantBits;
  const __m512 mag = _mm512_abs_ps(x);
  const __m512 q = _mm512_div_ps(mag, scale);
  const __m512i bits = _mm512_castps_si512(q);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, kShift), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32((1 << (kShift - 1)) - 1)));
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, kShift),
                                          _mm512_set1_epi32(kBiasShift << F::kMantBits));
  const __m512i sub = _mm512_cvt_roundps_epi32(_mm512_mul_ps(q, _mm512_set1_ps(F::kSubScale)),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 is_sub = _mm512_cmp_ps_mask(q, _mm512_set1_ps(kMinNormalCode), _CMP_LT_OQ);
  __m512i code = _mm512_mask_blend_epi32(is_sub, normal, sub);
  code = _mm512_min_epi32(code, _mm512_set1_epi32(F::kMaxCode));
  if constexpr (F::kSigned) {
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ) &
                          _mm512_test_epi32_mask(code, code);
    code = _mm512_mask_or_epi32(code, neg, code, _mm512_set1_epi32(0x80));
  } else {
    const __mmask16 nonzero = _mm512_cmp_ps_mask(mag, _mm512_setzero_ps(), _CMP_GT_OQ);
    code = _mm512_mask_max_epi32(code, nonzero, code, _mm512_set1_epi32(1));
  }
  return code;
}

inline void store_codes(uint8_t* dst, __m512i code) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(code));
}

template <class F, bool kSquare>
inline __m512 decode_vec(const uint8_t* src, __m512 scale) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m512i mag = F::kSigned ? _mm512_and_si512(c, _mm512_set1_epi32(0x7F)) : c;
  const __m512 normal = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_add_epi32(mag, _mm512_set1_epi32(kBiasShift << F::kMantBits)), 23 - F::kMantBits));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / F::kSubScale));
  const __mmask16 is_sub = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(1 << F::kMantBits));
  __m512 value = _mm512_mul_ps(_mm512_mask_blend_ps(is_sub, normal, sub), scale);
  if constexpr (F::kSigned) {
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
    value = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(value), sign));
  }
  return kSquare ? _mm512_mul_ps(value, value) : value;
}

#elif defined(__AVX2__) && defined(__FMA__)
// ---------------------------------------------------------------- AVX2: 8 codes
#define ZENFLOW_Q8_VECTOR 1
using VecI = __m256i;

inline __m256 vec_abs(__m256 x) {
  return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
}
inline __m256 vec_max(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
inline float vec_reduce_max(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
inline void vec_store(float* dst, __m256 x) { _mm256_storeu_ps(dst, x); }

template <class F>
inline __m256i encode_vec(__m256 x, __m256 scale) {
  constexpr int kShift = 23 - F::kMantBits;
  const __m256 mag = vec_abs(x);
  const __m256 q = _mm256_div_ps(mag, scale);
  const __m256i bits = _mm256_castps_si256(q);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, kShift), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32((1 << (kShift - 1)) - 1)));
  const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(rounded, kShift),
                                          _mm256_set1_epi32(kBiasShift << F::kMantBits));
  // The product is a whole number after the rounding, so the conversion is exact.
  const __m256i sub = _mm256_cvtps_epi32(
      _mm256_round_ps(_mm256_mul_ps(q, _mm256_set1_ps(F::kSubScale)),
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256 is_sub = _mm256_cmp_ps(q, _mm256_set1_ps(kMinNormalCode), _CMP_LT_OQ);
  __m256i code = _mm256_blendv_epi8(normal, sub, _mm256_castps_si256(is_sub));
  code = _mm256_min_epi32(code, _mm256_set1_epi32(F::kMaxCode));
  if constexpr (F::kSigned) {
    const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
    const __m256i nonzero = _mm256_cmpgt_epi32(code, _mm256_setzero_si256());
    code = _mm256_or_si256(
        code, _mm256_and_si256(_mm256_and_si256(neg, nonzero), _mm256_set1_epi32(0x80)));
  } else {
    const __m256i nonzero =
        _mm256_castps_si256(_mm256_cmp_ps(mag, _mm256_setzero_ps(), _CMP_GT_OQ));
    code = _mm256_max_epi32(code, _mm256_and_si256(nonzero, _mm256_set1_epi32(1)));
  }
  return code;
}

inline void store_codes(uint8_t* dst, __m256i code) {
  // Byte 0 of every 32-bit lane to the low 4 bytes of each 128-bit half, then the two
  // halves' low dwords together: 8 codes in the low 8 bytes.
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        -1, -1);
  const __m256i bytes = _mm256_shuffle_epi8(code, pick);
  const __m256i packed = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}

template <class F, bool kSquare>
inline __m256 decode_vec(const uint8_t* src, __m256 scale) {
  const __m256i c =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  const __m256i mag = F::kSigned ? _mm256_and_si256(c, _mm256_set1_epi32(0x7F)) : c;
  const __m256 normal = _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_add_epi32(mag, _mm256_set1_epi32(kBiasShift << F::kMantBits)), 23 - F::kMantBits));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / F::kSubScale));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(1 << F::kMantBits), mag);
  __m256 value =
      _mm256_mul_ps(_mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(is_sub)), scale);
  if constexpr (F::kSigned) {
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
    value = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(value), sign));
  }
  return kSquare ? _mm256_mul_ps(value, value) : value;
}
#endif  // vector bodies; the scalar fallback uses the scalar functions above only

// Largest |x[i]| of a block (max is exact, so the order does not matter).
inline float block_absmax(const float* x, int64_t len) {
  float amax = 0.0f;
  int64_t i = 0;
#if defined(ZENFLOW_Q8_VECTOR)
  Vec acc = vec_set1(0.0f);
  for (; i + kWidth <= len; i += kWidth) acc = vec_max(acc, vec_abs(vec_load(x + i)));
  amax = vec_reduce_max(acc);
#endif
  for (; i < len; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

// Codes of the len <= kQBlock values x of one block; returns the block's scale
// (absmax / QMAX, or 0 with all codes 0 for an all-zero block).
template <class F>
inline float quantize_block(const float* x, int64_t len, uint8_t* codes) {
  const float amax = block_absmax(x, len);
  if (amax == 0.0f) {
    std::memset(codes, 0, static_cast<size_t>(len));
    return 0.0f;
  }
  const float scale = amax / F::kQMax;
  int64_t i = 0;
#if defined(ZENFLOW_Q8_VECTOR)
  const Vec vscale = vec_set1(scale);
  for (; i + kWidth <= len; i += kWidth) store_codes(codes + i, encode_vec<F>(vec_load(x + i), vscale));
#endif
  for (; i < len; ++i) codes[i] = encode_scalar<F>(x[i], scale);
  return scale;
}

// The len <= kQBlock values of one block (squared when kSquare) into out.
template <class F, bool kSquare>
inline void dequantize_block(const uint8_t* codes, float scale, int64_t len, float* out) {
  int64_t i = 0;
#if defined(ZENFLOW_Q8_VECTOR)
  const Vec vscale = vec_set1(scale);
  for (; i + kWidth <= len; i += kWidth) vec_store(out + i, decode_vec<F, kSquare>(codes + i, vscale));
#endif
  for (; i < len; ++i) out[i] = decode_scalar<F, kSquare>(codes[i], scale);
}

}  // namespace
}  // namespace zenflow
