/* Storage-type conversions (bf16/f16 <-> f32), header-only and `declare target`
 * so host and device kernels share them. Round-to-nearest-even on narrowing;
 * NaN stays NaN. */
#ifndef FORKATTN_DTYPE_CONVERT_H
#define FORKATTN_DTYPE_CONVERT_H
#include <stddef.h>
#include <stdint.h>

#pragma omp declare target

/* Bit casts through a union (defined behaviour in C11). Not memcpy: a local
 * whose address is taken can be "globalized" by the OpenMP device compiler into
 * runtime-managed shared stack, which `ompx_bare` kernels do not set up
 * (bf16/f16 results were garbage or crashed on the H200 with memcpy here). */
typedef union fa_f32_bits {
  float f;
  uint32_t u;
} fa_f32_bits;

static inline float fa_bits_to_f32(uint32_t u) {
  fa_f32_bits b;
  b.u = u;
  return b.f;
}
static inline uint32_t fa_f32_to_bits(float f) {
  fa_f32_bits b;
  b.f = f;
  return b.u;
}

static inline float fa_bf16_to_f32(uint16_t h) { return fa_bits_to_f32((uint32_t)h << 16); }

static inline uint16_t fa_f32_to_bf16(float f) {
  uint32_t u = fa_f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline float fa_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return fa_bits_to_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return fa_bits_to_f32(sign);
    /* subnormal: value = man * 2^-24 */
    float v = (float)man * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return fa_bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t fa_f32_to_f16(float f) {
  uint32_t u = fa_f32_to_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);          /* NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);         /* overflow -> inf */
  if (a < 0x38800000u) {                                            /* subnormal or zero */
    float av = fa_bits_to_f32(a) * 16777216.0f;                     /* in units of 2^-24 */
    uint32_t m = (uint32_t)av;
    float rem = av - (float)m;
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) m++;
    return (uint16_t)(sign | m);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return (uint16_t)(sign | (r >> 13));
}

/* Element i of a buffer of the given dtype (0 f32, 1 bf16, 2 f16) as f32. */
static inline float fa_load(const void *p, int dtype, int64_t i) {
  if (dtype == 0) return ((const float *)p)[i];
  if (dtype == 1) return fa_bf16_to_f32(((const uint16_t *)p)[i]);
  return fa_f16_to_f32(((const uint16_t *)p)[i]);
}

static inline void fa_store(void *p, int dtype, int64_t i, float x) {
  if (dtype == 0)
    ((float *)p)[i] = x;
  else if (dtype == 1)
    ((uint16_t *)p)[i] = fa_f32_to_bf16(x);
  else
    ((uint16_t *)p)[i] = fa_f32_to_f16(x);
}

/* Bytes per element of a dtype (f32 4, bf16 and f16 2). */
static inline size_t fa_esize(int dtype) { return dtype == 0 ? 4 : 2; }

#pragma omp end declare target
#endif
