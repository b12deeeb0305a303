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
    if (a.apply_scale) g = _mm512_mul_ps(g, _mm512_set1_ps(a.grad_scale));
    if (a.l2_decay) g = _mm512_fmadd_ps(p, _mm512_set1_ps(a.weight_decay), g);
    if (a.decoupled_decay) p = _mm512_mul_ps(p, _mm512_set1_ps(a.decay_factor));
    m = _mm512_fmadd_ps(lerp_coeff, _mm512_sub_ps(g, m), lerp_small ? m : g);
    v = _mm512_mul_ps(v, _mm512_set1_ps(a.beta2));
    // addcmul_: torch's build contracts self + (value * t1) * t2 into one fused multiply-add
    v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(a.one_minus_beta2), g), g, v);
    __m512 root = _mm512_sqrt_ps(v);
    if (a.divide_bc2) root = _mm512_div_ps(root, _mm512_set1_ps(a.bias_correction2_sqrt));
    __m512 denom = _mm512_add_ps(root, _mm512_set1_ps(a.eps));
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(a.neg_step_size), m), denom));
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

#include "adam/isa_dispatch.inc"

}  // namespace

const IsaKernels& avx512_kernels() {
  static const IsaKernels table{"avx512", adam, traffic, sum_squares, any_nonfinite};
  return table;
}

}  // namespace offload_adam
