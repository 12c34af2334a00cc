/* Standalone driver: runs LLVMFuzzerTestOneInput over files, so a fuzz target's
 * corpus replays as an ordinary test with any compiler (no libFuzzer needed).
 *
 *   replay_<target> <file-or-directory>...
 *
 * A directory contributes every regular file in it (not recursively, hidden
 * files skipped), in name order. Each input is read into a buffer of exactly
 * its size, so a sanitizer build catches reads past the end. A target signals
 * a failure by aborting; the driver fails when no input was found. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz_common.h"

static int replay_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "replay: cannot open %s\n", path);
    return -1;
  }
  size_t cap = 4096, n = 0;
  unsigned char *all = malloc(cap);
  size_t got;
  while (all && (got = fread(all + n, 1, cap - n, f)) > 0) {
    n += got;
    if (n == cap) all = realloc(all, cap *= 2);
  }
  fclose(f);
  if (!all) {
    fprintf(stderr, "replay: out of memory reading %s\n", path);
    return -1;
  }
  unsigned char *exact = malloc(n ? n : 1); /* exactly n bytes: overreads are caught */
  if (!exact) {
    free(all);
    return -1;
  }
  memcpy(exact, all, n);
  free(all);
  printf("replay: %s (%zu bytes)\n", path, n);
  fflush(stdout);
  LLVMFuzzerTestOneInput(exact, n);
  free(exact);
  return 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int main(int argc, char **argv) {
  long inputs = 0;
  if (argc < 2) {
    fprintf(stderr, "usage: %s <corpus file or directory>...\n", argv[0]);
    return 2;
  }
  for (int a = 1; a < argc; a++) {
    struct stat sb;
    if (stat(argv[a], &sb)) {
      fprintf(stderr, "replay: %s does not exist\n", argv[a]);
      return 1;
    }
    if (!S_ISDIR(sb.st_mode)) {
      if (replay_file(argv[a])) return 1;
      inputs++;
      continue;
    }
    DIR *dir = opendir(argv[a]);
    if (!dir) {
      fprintf(stderr, "replay: cannot open directory %s\n", argv[a]);
      return 1;
    }
    size_t n = 0, cap = 64;
    char **names = malloc(sizeof *names * cap);
    struct dirent *e;
    while (names && (e = readdir(dir))) {
      if (e->d_name[0] == '.') continue;
      size_t len = strlen(argv[a]) + strlen(e->d_name) + 2;
      char *path = malloc(len);
      if (!path) break;
      snprintf(path, len, "%s/%s", argv[a], e->d_name);
      if (stat(path, &sb) || !S_ISREG(sb.st_mode)) {
        free(path);
        continue;
      }
      if (n == cap) names = realloc(names, sizeof *names * (cap *= 2));
      if (names) names[n++] = path;
    }
    closedir(dir);
    if (!names) {
      fprintf(stderr, "replay: out of memory listing %s\n", argv[a]);
      return 1;
    }
    qsort(names, n, sizeof *names, cmp_str);
    for (size_t i = 0; i < n; i++) {
      if (replay_file(names[i])) return 1;
      inputs++;
      free(names[i]);
    }
    free(names);
  }
  printf("replay: %ld inputs", inputs);
  if (fz_stat.calls)
    printf(", %ld attention calls (%ld ok, %ld invalid argument, %ld other; %ld poisoned, %ld checked "
           "against the float64 reference)",
           fz_stat.calls, fz_stat.ok, fz_stat.invalid, fz_stat.other, fz_stat.poisoned, fz_stat.ref_checked);
  printf("\n");
  if (!inputs) {
    fprintf(stderr, "replay: no inputs found\n");
    return 1;
  }
  return 0;
}
