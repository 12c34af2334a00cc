/* The in-kernel timeline's buffer and its host side (gpu_timeline.h). */
#include "gpu_timeline.h"

#ifdef FA_GPU_TIMELINE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#pragma omp declare target
/* visible: the host can update only an externally visible declare-target variable */
__attribute__((visibility("protected"))) unsigned long long fa_tl_buf[FA_TL_WORDS];
#pragma omp end declare target

/* The call count of kernel `name`, counted at its fa_gpu_timeline_begin; 0 when not recording. */
static int fa_tl_call(const char *name, int count) {
  static char names[8][32];
  static int calls[8];
  const char *path = getenv("FORKATTN_GPU_TIMELINE");
  if (!path || !*path) return 0;
  int k = 0;
  while (k < 8 && names[k][0] && strcmp(names[k], name) != 0) k++;
  if (k == 8) return 0;
  if (!names[k][0]) snprintf(names[k], sizeof names[k], "%s", name);
  return count ? ++calls[k] : calls[k];
}

static int fa_tl_wanted(void) {
  const char *c = getenv("FORKATTN_GPU_TIMELINE_CALL");
  return c && *c ? atoi(c) : 5;
}

void fa_gpu_timeline_begin(int device, const char *name) {
  if (fa_tl_call(name, 1) != fa_tl_wanted()) return;
  /* other kernels' events: the buffer is shared */
#pragma omp target teams distribute parallel for device(device)
  for (size_t i = 0; i < FA_TL_WORDS; i++) fa_tl_buf[i] = 0;
}

void fa_gpu_timeline_end(int device, const char *name) {
  const int call = fa_tl_call(name, 0);
  if (call != fa_tl_wanted()) return;
#pragma omp target update from(fa_tl_buf) device(device)
  char file[4096];
  snprintf(file, sizeof file, "%s.%s", getenv("FORKATTN_GPU_TIMELINE"), name);
  FILE *f = fopen(file, "wb");
  if (!f) {
    fprintf(stderr, "forkattn: timeline: cannot write %s\n", file);
    return;
  }
  const unsigned hdr[4] = {FA_TL_TEAMS, FA_TL_WARPS, FA_TL_CAP, (unsigned)call};
  fwrite(hdr, sizeof hdr, 1, f);
  fwrite(fa_tl_buf, sizeof fa_tl_buf[0], FA_TL_WORDS, f);
  fclose(f);
  fprintf(stderr, "forkattn: timeline of %s call %d written to %s\n", name, call, file);
}
#endif
