/* Shared pieces of the forkattn fuzz targets (tests/fuzz).
 *
 *  - fz_reader: turns fuzz bytes into sizes, enum values, strides and scales.
 *    Running out of bytes reads zeros, and a zero byte always means "the
 *    nominal (valid) value", so short inputs describe valid calls.
 *  - fz_case: one shared-prompt call (layout, eight tensor descriptors, lse,
 *    scale, memory). fz_case_run() backs every descriptor with a buffer of
 *    exactly the size it claims, predicts the status with an independent
 *    oracle written from include/forkattn.h, calls forkattn_prefix_fwd and
 *    forkattn_prefix_bwd on a CPU context, and checks the contract:
 *    documented status, the predicted verdict, a message on error, outputs and
 *    inputs untouched on error, inputs and the gaps between strided output
 *    elements untouched on success, finite outputs, and (small problems) the
 *    values against a float64 reference.
 *
 * A failed check prints what it saw and abort()s: libFuzzer records the input
 * as a crash, the replay driver (replay_main.c) fails the test.
 */
#ifndef FORKATTN_FUZZ_COMMON_H
#define FORKATTN_FUZZ_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "forkattn.h"

/* The libFuzzer entry point every target defines. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Abort with a message when cond is false (checks stay on in every build). */
#define FZ_CHECK(cond, ...)                                                                                  \
  do {                                                                                                       \
    if (!(cond)) fz_fail(__FILE__, __LINE__, #cond, __VA_ARGS__);                                            \
  } while (0)
void fz_fail(const char *file, int line, const char *cond, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5), noreturn))
#endif
    ;

/* ---- bytes to values ------------------------------------------------------ */

typedef struct fz_reader {
  const uint8_t *p;
  size_t n, i;
} fz_reader;

uint8_t fz_u8(fz_reader *r);
uint32_t fz_u32(fz_reader *r);
uint64_t fz_u64(fz_reader *r);

/* A signed size. tag = one byte:
 *   0x00..0xBF  base + tag % range                     (small, usually valid)
 *   0xC0..0xDF  fz_extremes[tag - 0xC0]                (0, -1, INT64_MIN/MAX, 2^31, 2^62, ...)
 *   0xE0..0xEF  (tag & 15) - 8                         (small negatives)
 *   0xF0..0xFF  the next 8 bytes, little-endian        (anything) */
int64_t fz_int(fz_reader *r, int64_t base, int64_t range);

/* A field with a nominal value. tag:
 *   0x00..0x7F  nominal
 *   0x80..0xBF  tag - 0x80 (0..63)
 *   0xC0..0xDF  fz_extremes[tag - 0xC0]
 *   0xE0..0xEF  nominal + (tag & 15) - 8 (two's-complement wrap)
 *   0xF0..0xFF  the next 8 bytes */
int64_t fz_field(fz_reader *r, int64_t nominal);

/* An enum value: tag < 0xF0 gives tag % nvalid (valid values 0..nvalid-1), else
 * an invalid int (nvalid, -1, INT_MIN, INT_MAX, ...). */
int fz_enum(fz_reader *r, int nvalid);

/* An enum-typed field with a nominal value, in the manner of fz_field (int range). */
int fz_enum_field(fz_reader *r, int nominal);

/* Softmax scale for head_dim d: tag < 0xE0 gives a sane positive value
 * (1/sqrt(d) times 0.25..4.1), else 0, -0, -1, NaN, +-inf, FLT_MAX, FLT_MIN,
 * a denormal, 1e30, 1e-30 or 4 raw bytes. */
float fz_scale(fz_reader *r, int64_t d);

/* The special float of tag & 15 among the first n of 0, -0, -1, NaN, +inf,
 * -inf, FLT_MAX, FLT_MIN, the smallest denormal, 1e30, 1e-30, 100, -NaN
 * (n <= 13); past them, 4 raw bytes read from r. */
float fz_special(fz_reader *r, uint8_t tag, int n);

#define FZ_NEXTREMES 32
extern const int64_t fz_extremes[FZ_NEXTREMES];

/* ---- one shared-prompt call ----------------------------------------------- */

enum { FZ_Q, FZ_K, FZ_V, FZ_O, FZ_DOUT, FZ_DQ, FZ_DK, FZ_DV, FZ_NT };
extern const char *const fz_tensor_names[FZ_NT];

/* Per-tensor data choice. */
enum {
  FZ_DATA_BACKED = 0, /* a buffer of exactly the claimed span (when it is sane and small) */
  FZ_DATA_NULL = 1    /* data = NULL */
};

typedef struct fz_case {
  int layout_null; /* pass layout = NULL */
  int64_t prompt_len, num_responses;
  int offsets_null; /* response_offsets = NULL */
  int64_t noff;     /* entries in offsets[] (0..FZ_MAX_OFFSETS) */
  int64_t offsets[66];
  int mask; /* raw enum value */

  forkattn_tensor t[FZ_NT]; /* data is filled in by fz_case_run */
  int t_null[FZ_NT];        /* pass a NULL descriptor */
  int t_data[FZ_NT];        /* FZ_DATA_* */

  int fwd_lse_null, bwd_lse_null;
  float scale;
  int memory;    /* raw enum value */
  uint32_t seed; /* data values */
} fz_case;

#define FZ_MAX_OFFSETS 66
/* Largest buffer one descriptor may claim; larger spans are not backed. */
#define FZ_CAP_BYTES ((int64_t)1 << 20)
/* Largest T*T*Hq*(d+16) computed; larger valid calls are poisoned (kept fast). */
#define FZ_MAX_WORK 1e6

/* A CPU context with one thread, created on first use (FORKATTN_BACKEND is
 * unset first so the environment cannot redirect it). */
forkattn_ctx *fz_cpu_ctx(void);

/* Run forward then backward of c and check everything (see the top). */
void fz_case_run(forkattn_ctx *ctx, fz_case *c);

/* Fill a descriptor as a contiguous [rows, heads, d] tensor (no overflow traps). */
void fz_contiguous(forkattn_tensor *t, int dtype, int64_t rows, int64_t heads, int64_t d);

/* Statistics of this process (printed by the replay driver). */
typedef struct fz_stats {
  long calls, ok, invalid, other, poisoned, ref_checked;
} fz_stats;
extern fz_stats fz_stat;

#endif
