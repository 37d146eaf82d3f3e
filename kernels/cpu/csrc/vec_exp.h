// exp (and the soft-cap built on it) on 16 fp32 lanes (AVX-512) or 8 (AVX2), shared by the
// decode and prefill attention kernels.
#pragma once
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>

// 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), exp(r) by Cephes
// expf's polynomial (< 2 ulp against std::exp), 2^n by vscalefps. Inputs are s - max <= 0
// here; below -87 the result is 0 to fp32's precision anyway. (glibc's vector expf leaves
// its fast path for such inputs: lanes far below -87, as masked scores, each went through
// a scalar call.)
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// exp16's arithmetic on 8 lanes; 2^n built in the exponent field (n >= -126 after the
// clamp, so a normal float).
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// Attention-logit soft-capping, cap * tanh(x / cap) (Gemma 2), on scores already scaled.
// tanh as Cephes tanhf computes it (~2 ulp): an odd polynomial below |y| = 0.625, where
// 1 - 2 / (exp(2|y|) + 1) would lose its low bits to the subtraction (times a cap of 50,
// 1e-5 of a score), else (1 - e) / (1 + e) with e = exp(-2|y|) <= 1 (the inputs exp16 and
// exp8 take), the sign put back.
#if defined(__AVX512F__)
static inline __m512 softcap16(__m512 x, __m512 cap, __m512 inv_cap) {
  const __m512 y = _mm512_mul_ps(x, inv_cap);
  const __m512 a = _mm512_abs_ps(y);
  const __m512 z = _mm512_mul_ps(y, y);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), y, y);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
  const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(INT32_MIN));
  const __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ),
                                        _mm512_castsi512_ps(_mm512_or_si512(
                                            _mm512_castps_si512(big), sign)),
                                        small);
  return _mm512_mul_ps(t, cap);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 softcap8(__m256 x, __m256 cap, __m256 inv_cap) {
  const __m256 y = _mm256_mul_ps(x, inv_cap);
  const __m256 sign_bit = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  const __m256 a = _mm256_andnot_ps(sign_bit, y);
  const __m256 z = _mm256_mul_ps(y, y);
  __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), y, y);
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp8(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
  const __m256 big = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)),
                                  _mm256_and_ps(y, sign_bit));
  const __m256 t = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f),
                                                              _CMP_LT_OQ));
  return _mm256_mul_ps(t, cap);
}
#endif

// s[0 .. n) = cap * tanh(s / cap), in place. Not inlined: inlined into the bf16 prefill's
// row loop, the call it never takes without a cap made that kernel ~9% slower (a 512-token
// chunk, side by side with the build before the soft-cap).
__attribute__((noinline)) static void softcap_scores(float* s, int64_t n, float cap) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 c = _mm512_set1_ps(cap), ic = _mm512_set1_ps(1.0f / cap);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, softcap16(_mm512_loadu_ps(s + i), c, ic));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(s + i, m, softcap16(_mm512_maskz_loadu_ps(m, s + i), c, ic));
    i = n;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 c = _mm256_set1_ps(cap), ic = _mm256_set1_ps(1.0f / cap);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, softcap8(_mm256_loadu_ps(s + i), c, ic));
#endif
  for (; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}
