// AVX2 variant (with FMA and F16C): 8 fp32 lanes. The tail (< 8 elements) is copied into
// zero-padded stack buffers owned by adam_partial and run through the same vector code, so it
// gets exactly the same instructions as the body.
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include "adam/adam_kernels.h"

namespace offload_adam {
namespace {

template <int GradType>
inline __m256 load_grad(const void* grad, size_t i) {
  if (GradType == kF32) return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
  if (GradType == kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

// Round to nearest even like c10::BFloat16, NaN -> 0x7fc0.
inline __m128i to_bf16(__m256 p) {
  __m256i u = _mm256_castps_si256(p);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

// One 8-element step on the given buffers: reads the sources (param_in, grad, exp_avg_in,
// exp_avg_sq_in), writes the destinations (param, exp_avg, exp_avg_sq, out16). The real
// arrays, or the tail's stack copies (each source then its own destination).
// Stream: param_out16 + i is 16-byte aligned and written with a non-temporal store.
// Traffic: the same loads and stores around trivial arithmetic (the benchmark's bandwidth
// limit of this access pattern), not an Adam step.
template <int GradType, int OutType, bool Traffic, bool Stream = false>
inline void adam_vector(const AdamArgs& a, const float* param_in, const void* grad, const float* exp_avg_in,
                        const float* exp_avg_sq_in, float* param, float* exp_avg, float* exp_avg_sq,
                        uint16_t* out16, size_t i, bool lerp_small, __m256 lerp_coeff) {
  __m256 g = load_grad<GradType>(grad, i);
  __m256 p = _mm256_loadu_ps(param_in + i);
  __m256 m = _mm256_loadu_ps(exp_avg_in + i);
  __m256 v = _mm256_loadu_ps(exp_avg_sq_in + i);
  if (Traffic) {
    p = _mm256_add_ps(p, g);
    m = _mm256_add_ps(m, g);
    v = _mm256_add_ps(v, g);
  } else {
    if (a.apply_scale) g = _mm256_mul_ps(g, _mm256_set1_ps(a.grad_scale));
    if (a.l2_decay) g = _mm256_fmadd_ps(p, _mm256_set1_ps(a.weight_decay), g);
    if (a.decoupled_decay) p = _mm256_mul_ps(p, _mm256_set1_ps(a.decay_factor));
    m = _mm256_fmadd_ps(lerp_coeff, _mm256_sub_ps(g, m), lerp_small ? m : g);
    v = _mm256_mul_ps(v, _mm256_set1_ps(a.beta2));
    // addcmul_: torch's build contracts self + (value * t1) * t2 into one fused multiply-add
    v = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(a.one_minus_beta2), g), g, v);
    __m256 root = _mm256_sqrt_ps(v);
    if (a.divide_bc2) root = _mm256_div_ps(root, _mm256_set1_ps(a.bias_correction2_sqrt));
    __m256 denom = _mm256_add_ps(root, _mm256_set1_ps(a.eps));
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(a.neg_step_size), m), denom));
  }
  _mm256_storeu_ps(param + i, p);
  _mm256_storeu_ps(exp_avg + i, m);
  _mm256_storeu_ps(exp_avg_sq + i, v);
  if (OutType == kNone) return;
  const __m128i half =
      OutType == kBF16 ? to_bf16(p) : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if (Stream)
    _mm_stream_si128(reinterpret_cast<__m128i*>(out16 + i), half);
  else
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out16 + i), half);
}

// Elements [i, i + rest), rest < 8: copied from the sources into zero-padded stack buffers
// owned by this call, run through the same vector code in place, copied out to the
// destinations.
template <int GradType, int OutType, bool Traffic>
inline void adam_partial(const AdamArgs& a, size_t i, size_t rest, bool lerp_small, __m256 lerp_coeff) {
  const size_t grad_bytes = GradType == kF32 ? 4 : 2;
  alignas(32) float param[8] = {0}, exp_avg[8] = {0}, exp_avg_sq[8] = {0};
  alignas(32) unsigned char grad[32] = {0};
  alignas(32) uint16_t out[8] = {0};
  uint16_t* out16 = static_cast<uint16_t*>(a.param_out16);
  std::memcpy(param, a.param_in + i, rest * 4);
  std::memcpy(exp_avg, a.exp_avg_in + i, rest * 4);
  std::memcpy(exp_avg_sq, a.exp_avg_sq_in + i, rest * 4);
  std::memcpy(grad, static_cast<const unsigned char*>(a.grad) + i * grad_bytes, rest * grad_bytes);
  adam_vector<GradType, OutType, Traffic>(a, param, grad, exp_avg, exp_avg_sq, param, exp_avg, exp_avg_sq,
                                          out, 0, lerp_small, lerp_coeff);
  std::memcpy(a.param + i, param, rest * 4);
  std::memcpy(a.exp_avg + i, exp_avg, rest * 4);
  std::memcpy(a.exp_avg_sq + i, exp_avg_sq, rest * 4);
  if (OutType != kNone) std::memcpy(out16 + i, out, rest * 2);
}

// The streaming loop: elements up to the first 64-byte boundary of param_out16 go through
// the stack-buffer path, then full vectors with non-temporal stores of param_out16, then the
// tail; a store fence makes the streamed stores globally visible before the range returns.
template <int GradType, int OutType, bool Traffic>
void adam_stream(const AdamArgs& a, size_t begin, size_t end, bool lerp_small, __m256 lerp_coeff) {
  uint16_t* out16 = static_cast<uint16_t*>(a.param_out16);
  size_t i = begin;
  {
    const uintptr_t address = reinterpret_cast<uintptr_t>(out16 + i);
    size_t head = min_size(end - i, ((64 - (address & 63)) & 63) / 2);
    for (; head > 0;) {
      const size_t k = min_size(head, 7);
      adam_partial<GradType, OutType, Traffic>(a, i, k, lerp_small, lerp_coeff);
      i += k;
      head -= k;
    }
  }
  for (; i + 8 <= end; i += 8)
    adam_vector<GradType, OutType, Traffic, true>(a, a.param_in, a.grad, a.exp_avg_in, a.exp_avg_sq_in,
                                                  a.param, a.exp_avg, a.exp_avg_sq, out16, i, lerp_small,
                                                  lerp_coeff);
  if (i < end) adam_partial<GradType, OutType, Traffic>(a, i, end - i, lerp_small, lerp_coeff);
  _mm_sfence();
}

template <int GradType, int OutType, bool Traffic>
void adam_range(const AdamArgs& args, size_t begin, size_t end) {
  // A local copy: with -fno-strict-aliasing every store could otherwise alias the caller's
  // AdamArgs and force its fields to be reloaded each iteration.
  const AdamArgs a = args;
  const bool lerp_small = __builtin_fabsf(a.beta1_weight) < 0.5f;
  const __m256 lerp_coeff = _mm256_set1_ps(lerp_small ? a.beta1_weight : a.beta1_weight - 1.0f);
  // A param_out16 at an odd address cannot be aligned for streaming stores (a 16-bit tensor
  // from torch never is).
  if (OutType != kNone && a.stream && (reinterpret_cast<uintptr_t>(a.param_out16) & 1) == 0)
    return adam_stream<GradType, OutType, Traffic>(a, begin, end, lerp_small, lerp_coeff);
  uint16_t* out16 = static_cast<uint16_t*>(a.param_out16);
  size_t i = begin;
  for (; i + 8 <= end; i += 8)
    adam_vector<GradType, OutType, Traffic>(a, a.param_in, a.grad, a.exp_avg_in, a.exp_avg_sq_in, a.param,
                                            a.exp_avg, a.exp_avg_sq, out16, i, lerp_small, lerp_coeff);
  if (i < end) adam_partial<GradType, OutType, Traffic>(a, i, end - i, lerp_small, lerp_coeff);
}

#include "adam/isa_dispatch.inc"

}  // namespace

const IsaKernels& avx2_kernels() {
  static const IsaKernels table{"avx2", adam, traffic, sum_squares, any_nonfinite};
  return table;
}

}  // namespace offload_adam
