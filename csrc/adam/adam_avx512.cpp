// AVX-512 variant (F, BW, VL, DQ): 16 fp32 lanes, masked loads/stores for the tail so the
// tail goes through exactly the same instructions as the body.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
// GCC 12 warns about the deliberately undefined registers inside its own avx512fintrin.h.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include "adam/adam_kernels.h"

namespace offload_adam {
namespace {

template <int GradType>
inline __m512 load_grad(const void* grad, size_t i, __mmask16 mask) {
  if (GradType == kF32) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(grad) + i);
  __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(grad) + i);
  if (GradType == kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

// Round to nearest even like c10::BFloat16, NaN -> 0x7fc0.
inline __m256i to_bf16(__m512 p) {
  __m512i u = _mm512_castps_si512(p);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  __mmask16 is_nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
}

// AdamW on one vector, the operations of torch's single-tensor AdamW in its order: updates
// p, m, v and returns sqrt(v') (before bias correction).
inline __m512 adamw_math(const AdamArgs& a, __m512 g, __m512& p, __m512& m, __m512& v, bool lerp_small,
                         __m512 lerp_coeff) {
  if (a.apply_scale) g = _mm512_mul_ps(g, _mm512_set1_ps(a.grad_scale));
  if (a.l2_decay) g = _mm512_fmadd_ps(p, _mm512_set1_ps(a.weight_decay), g);
  if (a.decoupled_decay) p = _mm512_mul_ps(p, _mm512_set1_ps(a.decay_factor));
  m = _mm512_fmadd_ps(lerp_coeff, _mm512_sub_ps(g, m), lerp_small ? m : g);
  v = _mm512_mul_ps(v, _mm512_set1_ps(a.beta2));
  // addcmul_: torch's build contracts self + (value * t1) * t2 into one fused multiply-add
  v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(a.one_minus_beta2), g), g, v);
  const __m512 sqrt_v = _mm512_sqrt_ps(v);
  __m512 root = sqrt_v;
  if (a.divide_bc2) root = _mm512_div_ps(root, _mm512_set1_ps(a.bias_correction2_sqrt));
  __m512 denom = _mm512_add_ps(root, _mm512_set1_ps(a.eps));
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(a.neg_step_size), m), denom));
  return sqrt_v;
}

// Reads the sources (param_in, grad, exp_avg_in, exp_avg_sq_in) and writes the destinations
// (param, exp_avg, exp_avg_sq, param_out16), elements i + lane for the lanes set in mask.
// Stream: a full, unmasked vector whose param_out16 destination is 32-byte aligned, written
// with a non-temporal store. Traffic: the same loads and stores around trivial arithmetic (the
// benchmark's bandwidth limit of this access pattern), not an Adam step.
template <int GradType, int OutType, bool Traffic, bool Stream = false>
inline void adam_vector(const AdamArgs& a, size_t i, __mmask16 mask, bool lerp_small, __m512 lerp_coeff) {
  __m512 g = load_grad<GradType>(a.grad, i, mask);
  __m512 p = _mm512_maskz_loadu_ps(mask, a.param_in + i);
  __m512 m = _mm512_maskz_loadu_ps(mask, a.exp_avg_in + i);
  __m512 v = _mm512_maskz_loadu_ps(mask, a.exp_avg_sq_in + i);
  if (Traffic) {
    p = _mm512_add_ps(p, g);
    m = _mm512_add_ps(m, g);
    v = _mm512_add_ps(v, g);
  } else {
    adamw_math(a, g, p, m, v, lerp_small, lerp_coeff);
  }
  _mm512_mask_storeu_ps(a.param + i, mask, p);
  _mm512_mask_storeu_ps(a.exp_avg + i, mask, m);
  _mm512_mask_storeu_ps(a.exp_avg_sq + i, mask, v);
  if (OutType == kNone) return;
  uint16_t* out16 = static_cast<uint16_t*>(a.param_out16);
  const __m256i half =
      OutType == kBF16 ? to_bf16(p) : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if (Stream)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out16 + i), half);
  else
    _mm256_mask_storeu_epi16(out16 + i, mask, half);
}

// The streaming loop: elements up to the first 64-byte boundary of param_out16 go through
// masked vectors (the same instructions as the body), then full vectors with non-temporal
// stores, then the masked tail; a store fence makes the streamed stores globally visible
// before the range returns.
template <int GradType, int OutType, bool Traffic>
void adam_stream(const AdamArgs& a, size_t begin, size_t end, bool lerp_small, __m512 lerp_coeff) {
  size_t i = begin;
  {
    const uintptr_t address = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(a.param_out16) + i);
    size_t head = min_size(end - i, ((64 - (address & 63)) & 63) / 2);
    for (; head > 0;) {
      const size_t k = min_size(head, 16);
      adam_vector<GradType, OutType, Traffic>(a, i, __mmask16((1u << k) - 1u), lerp_small, lerp_coeff);
      i += k;
      head -= k;
    }
  }
  for (; i + 16 <= end; i += 16)
    adam_vector<GradType, OutType, Traffic, true>(a, i, 0xffff, lerp_small, lerp_coeff);
  if (i < end)
    adam_vector<GradType, OutType, Traffic>(a, i, __mmask16((1u << (end - i)) - 1u), lerp_small, lerp_coeff);
  _mm_sfence();
}

template <int GradType, int OutType, bool Traffic>
void adam_range(const AdamArgs& args, size_t begin, size_t end) {
  // A local copy: with -fno-strict-aliasing every store could otherwise alias the caller's
  // AdamArgs and force its fields to be reloaded each iteration.
  const AdamArgs a = args;
  const bool lerp_small = __builtin_fabsf(a.beta1_weight) < 0.5f;
  const __m512 lerp_coeff = _mm512_set1_ps(lerp_small ? a.beta1_weight : a.beta1_weight - 1.0f);
  // A param_out16 at an odd address cannot be aligned for streaming stores (a 16-bit tensor
  // from torch never is).
  if (OutType != kNone && a.stream && (reinterpret_cast<uintptr_t>(a.param_out16) & 1) == 0)
    return adam_stream<GradType, OutType, Traffic>(a, begin, end, lerp_small, lerp_coeff);
  size_t i = begin;
  for (; i + 16 <= end; i += 16)
    adam_vector<GradType, OutType, Traffic>(a, i, 0xffff, lerp_small, lerp_coeff);
  if (i < end)
    adam_vector<GradType, OutType, Traffic>(a, i, __mmask16((1u << (end - i)) - 1u), lerp_small, lerp_coeff);
}

// ---- compact moments (docs/compact_state.md) --------------------------------------------
// The same operations as adam_avx2.cpp's, 16 lanes; partial vectors and the call's last
// partial block through zero-masked loads and masked stores (zeros step to zero moments, so
// masked-off lanes leave a block's largest magnitudes alone).

// The random words of elements first .. first + 15 (first = position + index, mod 2^32).
inline __m512i random_words(uint32_t key, uint32_t first) {
  __m512i h = _mm512_add_epi32(_mm512_set1_epi32(int(first)),
                               _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  h = _mm512_xor_si512(h, _mm512_set1_epi32(int(key)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0x85EBCA6Bu)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0xC2B2AE35u)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

inline __m512 load_bf16(const uint16_t* src, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// bf16 with stochastic rounding: r (< 2^16) added below the kept bits; NaN -> 0x7fc0.
inline __m256i encode_bf16_vector(__m512 x, __m512i r) {
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  h = _mm512_mask_mov_epi32(h, is_nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(h);
}

// 16 codes (bytes) widened to 32-bit lanes, masked-off lanes zero.
inline __m512i load_codes(const uint8_t* src, __mmask16 mask) {
  return _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, src));
}

// value(c) of the codes' magnitudes c: float((c + normal_base) << shift) from the first normal
// code on, float((c + sub_base) << shift) - 2^-14 below it (exact).
template <int Shift, int SubBase, int NormalBase>
inline __m512 code_values(__m512i c) {
  const __mmask16 normal = _mm512_cmpgt_epi32_mask(c, _mm512_set1_epi32((1 << (23 - Shift)) - 1));
  const __m512i base =
      _mm512_mask_mov_epi32(_mm512_set1_epi32(SubBase), normal, _mm512_set1_epi32(NormalBase));
  const __m512 value = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(c, base), Shift));
  const __m512 shifted = _mm512_sub_ps(value, _mm512_castsi512_ps(_mm512_set1_epi32(int(kTwoPowM14Bits))));
  return _mm512_mask_mov_ps(shifted, normal, value);
}

inline __m512 decode_e4m3_vector(__m512i code, __m512 scale) {
  const __m512 value = code_values<20, 904, 896>(_mm512_and_si512(code, _mm512_set1_epi32(127)));
  const __m512 x = _mm512_mul_ps(value, scale);
  return _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(x), _mm512_slli_epi32(_mm512_srli_epi32(code, 7), 31)));
}

inline __m512 decode_e4m4_vector(__m512i code, __m512 scale) {
  const __m512 value = code_values<19, 1808, 1792>(code);
  return _mm512_mul_ps(value, scale);
}

// Codes of y = |x| * inverse rounded with r below the kept bits (docs/compact_state.md).
template <int Shift, int SubBase, int NormalBase, int Top>
inline __m512i encode_magnitude_vector(__m512 x, __m512 inverse, __m512i r) {
  const __m512 two_pow_m14 = _mm512_castsi512_ps(_mm512_set1_epi32(int(kTwoPowM14Bits)));
  const __m512 y = _mm512_mul_ps(
      _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff))), inverse);
  const __mmask16 small = _mm512_cmp_ps_mask(y, two_pow_m14, _CMP_LT_OQ);
  const __m512i sub = _mm512_sub_epi32(
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(_mm512_add_ps(y, two_pow_m14)), r), Shift),
      _mm512_set1_epi32(SubBase));
  const __m512i normal = _mm512_sub_epi32(
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(y), r), Shift), _mm512_set1_epi32(NormalBase));
  const __m512i c = _mm512_mask_mov_epi32(normal, small, sub);
  return _mm512_min_epi32(c, _mm512_set1_epi32(Top));  // codes are >= 0
}

inline __m512i encode_e4m3_vector(__m512 x, __m512 inverse, __m512i word) {
  const __m512i c = encode_magnitude_vector<20, 904, 896, 127>(
      x, inverse, _mm512_and_si512(word, _mm512_set1_epi32(0xFFFFF)));
  return _mm512_or_si512(c, _mm512_slli_epi32(_mm512_srli_epi32(_mm512_castps_si512(x), 31), 7));
}

inline __m512i encode_e4m4_vector(__m512 root, __m512 inverse, __m512i word) {
  return encode_magnitude_vector<19, 1808, 1792, 255>(root, inverse, _mm512_srli_epi32(word, 13));
}

// Largest of |x| over 2 vectors, as bits.
inline uint32_t largest_magnitude(const __m512 (&x)[2]) {
  const __m512i mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i a = _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(x[0]), mask),
                                     _mm512_and_si512(_mm512_castps_si512(x[1]), mask));
  return _mm512_reduce_max_epu32(a);
}

template <int OutType>
inline void store_out16(uint16_t* out16, __m512 p, __mmask16 mask) {
  if (OutType == kNone) return;
  const __m256i half =
      OutType == kBF16 ? to_bf16(p) : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_mask_storeu_epi16(out16, mask, half);
}

// Elements i + lane (lanes in mask) with bf16 moments.
template <int GradType, int OutType, bool Traffic>
inline void bf16_vector(const CompactArgs& c, size_t i, __mmask16 mask, bool lerp_small, __m512 lerp_coeff) {
  const AdamArgs& a = c.step;
  const uint16_t* m_in = static_cast<const uint16_t*>(c.exp_avg_in) + i;
  const uint16_t* v_in = static_cast<const uint16_t*>(c.exp_avg_sq_in) + i;
  uint16_t* m_out = static_cast<uint16_t*>(c.exp_avg) + i;
  uint16_t* v_out = static_cast<uint16_t*>(c.exp_avg_sq) + i;
  __m512 g = load_grad<GradType>(a.grad, i, mask);
  __m512 p = _mm512_maskz_loadu_ps(mask, a.param_in + i);
  if (Traffic) {
    p = _mm512_add_ps(p, g);
    const __m256i one = _mm256_set1_epi16(1);
    _mm256_mask_storeu_epi16(m_out, mask, _mm256_add_epi16(_mm256_maskz_loadu_epi16(mask, m_in), one));
    _mm256_mask_storeu_epi16(v_out, mask, _mm256_add_epi16(_mm256_maskz_loadu_epi16(mask, v_in), one));
  } else {
    __m512 m = load_bf16(m_in, mask);
    __m512 v = load_bf16(v_in, mask);
    adamw_math(a, g, p, m, v, lerp_small, lerp_coeff);
    const __m512i word = random_words(c.key, uint32_t(c.position + i));
    _mm256_mask_storeu_epi16(m_out, mask,
                             encode_bf16_vector(m, _mm512_and_si512(word, _mm512_set1_epi32(0xFFFF))));
    _mm256_mask_storeu_epi16(v_out, mask, encode_bf16_vector(v, _mm512_srli_epi32(word, 16)));
  }
  _mm512_mask_storeu_ps(a.param + i, mask, p);
  store_out16<OutType>(static_cast<uint16_t*>(a.param_out16) + i, p, mask);
}

template <int GradType, int OutType, bool Traffic>
void bf16_range(const CompactArgs& args, size_t begin, size_t end) {
  const CompactArgs c = args;  // a local copy (see adam_range)
  const bool lerp_small = __builtin_fabsf(c.step.beta1_weight) < 0.5f;
  const __m512 lerp_coeff = _mm512_set1_ps(lerp_small ? c.step.beta1_weight : c.step.beta1_weight - 1.0f);
  size_t i = begin;
  for (; i + 16 <= end; i += 16)
    bf16_vector<GradType, OutType, Traffic>(c, i, 0xffff, lerp_small, lerp_coeff);
  if (i < end)
    bf16_vector<GradType, OutType, Traffic>(c, i, __mmask16((1u << (end - i)) - 1u), lerp_small, lerp_coeff);
}

// One block of int8 moments at element i (count <= 32 elements: 2 vectors, masked): decode,
// step, the block's largest magnitudes, encode.
template <int GradType, int OutType, bool Traffic>
inline void int8_block(const CompactArgs& c, size_t i, size_t count, bool lerp_small, __m512 lerp_coeff) {
  const AdamArgs& a = c.step;
  const size_t block = i / kInt8Block;
  const uint8_t* m_in = static_cast<const uint8_t*>(c.exp_avg_in) + i;
  const uint8_t* v_in = static_cast<const uint8_t*>(c.exp_avg_sq_in) + i;
  uint8_t* m_out = static_cast<uint8_t*>(c.exp_avg) + i;
  uint8_t* v_out = static_cast<uint8_t*>(c.exp_avg_sq) + i;
  uint16_t* out16 = static_cast<uint16_t*>(a.param_out16) + i;
  const __mmask16 masks[2] = {__mmask16(count >= 16 ? 0xffffu : (1u << count) - 1u),
                              __mmask16(count >= 32   ? 0xffffu
                                        : count <= 16 ? 0u
                                                      : (1u << (count - 16)) - 1u)};
  const uint32_t m_exponent_in = c.exp_avg_exponents_in[block];
  const uint32_t v_exponent_in = c.exp_avg_sq_exponents_in[block];
  if (Traffic) {
    const __m128i one = _mm_set1_epi8(1);
    for (int k = 0; k < 2; ++k) {
      const size_t j = i + 16 * k;
      const __m512 p = _mm512_add_ps(_mm512_maskz_loadu_ps(masks[k], a.param_in + j),
                                     load_grad<GradType>(a.grad, j, masks[k]));
      _mm512_mask_storeu_ps(a.param + j, masks[k], p);
      store_out16<OutType>(out16 + 16 * k, p, masks[k]);
      _mm_mask_storeu_epi8(m_out + 16 * k, masks[k],
                           _mm_add_epi8(_mm_maskz_loadu_epi8(masks[k], m_in + 16 * k), one));
      _mm_mask_storeu_epi8(v_out + 16 * k, masks[k],
                           _mm_add_epi8(_mm_maskz_loadu_epi8(masks[k], v_in + 16 * k), one));
    }
    c.exp_avg_exponents[block] = uint8_t(m_exponent_in + 1);
    c.exp_avg_sq_exponents[block] = uint8_t(v_exponent_in + 1);
    return;
  }
  const __m512 m_scale = _mm512_set1_ps(exponent_scale(m_exponent_in));
  const __m512 v_scale = _mm512_set1_ps(exponent_scale(v_exponent_in));
  __m512 ms[2], roots[2];
  for (int k = 0; k < 2; ++k) {
    const size_t j = i + 16 * k;
    __m512 g = load_grad<GradType>(a.grad, j, masks[k]);
    __m512 p = _mm512_maskz_loadu_ps(masks[k], a.param_in + j);
    __m512 m = decode_e4m3_vector(load_codes(m_in + 16 * k, masks[k]), m_scale);
    const __m512 stored_root = decode_e4m4_vector(load_codes(v_in + 16 * k, masks[k]), v_scale);
    __m512 v = _mm512_mul_ps(stored_root, stored_root);
    roots[k] = adamw_math(a, g, p, m, v, lerp_small, lerp_coeff);
    // masked-off lanes: zero (a NaN scale would otherwise reach them)
    ms[k] = _mm512_maskz_mov_ps(masks[k], m);
    roots[k] = _mm512_maskz_mov_ps(masks[k], roots[k]);
    _mm512_mask_storeu_ps(a.param + j, masks[k], p);
    store_out16<OutType>(out16 + 16 * k, p, masks[k]);
  }
  const uint32_t m_e = block_exponent(largest_magnitude(ms));
  const uint32_t v_e = block_exponent(largest_magnitude(roots));
  const __m512 m_inverse = _mm512_set1_ps(exponent_inverse(m_e));
  const __m512 v_inverse = _mm512_set1_ps(exponent_inverse(v_e));
  for (int k = 0; k < 2; ++k) {
    const __m512i word = random_words(c.key, uint32_t(c.position + i + 16 * k));
    const __m512i m_codes = m_e == 255 ? _mm512_setzero_si512() : encode_e4m3_vector(ms[k], m_inverse, word);
    const __m512i v_codes =
        v_e == 255 ? _mm512_setzero_si512() : encode_e4m4_vector(roots[k], v_inverse, word);
    _mm_mask_storeu_epi8(m_out + 16 * k, masks[k], _mm512_cvtepi32_epi8(m_codes));
    _mm_mask_storeu_epi8(v_out + 16 * k, masks[k], _mm512_cvtepi32_epi8(v_codes));
  }
  c.exp_avg_exponents[block] = uint8_t(m_e);
  c.exp_avg_sq_exponents[block] = uint8_t(v_e);
}

template <int GradType, int OutType, bool Traffic>
void int8_range(const CompactArgs& args, size_t begin, size_t end) {
  const CompactArgs c = args;  // a local copy (see adam_range)
  const bool lerp_small = __builtin_fabsf(c.step.beta1_weight) < 0.5f;
  const __m512 lerp_coeff = _mm512_set1_ps(lerp_small ? c.step.beta1_weight : c.step.beta1_weight - 1.0f);
  for (size_t i = begin; i < end; i += kInt8Block)
    int8_block<GradType, OutType, Traffic>(c, i, min_size(kInt8Block, end - i), lerp_small, lerp_coeff);
}

template <int Moment, int GradType, int OutType, bool Traffic>
void compact_range(const CompactArgs& c, size_t begin, size_t end) {
  if constexpr (Moment == kMomentInt8)
    int8_range<GradType, OutType, Traffic>(c, begin, end);
  else
    bf16_range<GradType, OutType, Traffic>(c, begin, end);
}

#include "adam/isa_dispatch.inc"

}  // namespace

const IsaKernels& avx512_kernels() {
  static const IsaKernels table{"avx512",      adam,         traffic,        sum_squares,
                                any_nonfinite, adam_compact, compact_traffic};
  return table;
}

}  // namespace offload_adam
