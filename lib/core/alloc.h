/* Every host allocation the library makes goes through these, so a test build
 * (-DFORKATTN_ALLOC_TEST=ON) can fail the Nth one and check that each failure
 * returns FORKATTN_ERR_OUT_OF_MEMORY, leaks nothing, and the next call works. */
#ifndef FORKATTN_ALLOC_H
#define FORKATTN_ALLOC_H
#include <stddef.h>
#include <stdint.h>

void *fa_malloc(size_t bytes);
void *fa_calloc(size_t count, size_t size);
/* fa_malloc of count elements of size bytes each; NULL when count < 0 or the
 * byte count overflows size_t (sizes derived from user input go through this
 * or a checked product, never a bare multiplication). */
void *fa_malloc_array(int64_t count, size_t size);
/* 64-byte aligned; bytes is rounded up to a multiple of 64. */
void *fa_aligned_alloc(size_t bytes);
void fa_free(void *p);
/* Non-zero when the allocation about to be made (host or device) must fail
 * (FORKATTN_ALLOC_TEST builds only; always 0 otherwise). Counts one allocation. */
int fa_alloc_inject_failure(void);

#endif
