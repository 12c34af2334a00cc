/* test_runner.h - Criterion, or (with FORKATTN_TEST_STANDALONE, in the
 * ThreadSanitizer build) a minimal stand-in runner with the same Test() and
 * cr_assert()/cr_expect() spellings. Include it once, from a test's .c file. */
#ifndef FORKATTN_TESTS_RUNNER_H
#define FORKATTN_TESTS_RUNNER_H
#ifndef FORKATTN_TEST_STANDALONE
#include <criterion/criterion.h>
#else
/* ---- stand-in for Criterion's runner (ThreadSanitizer build only) ----------
 * Criterion's runner does not survive ThreadSanitizer: it maps its shared
 * arena at random addresses that fall into TSan's reserved ranges and aborts
 * or crashes before or between tests (Snaipe/Criterion#274). The TSan build
 * (tests/CMakeLists.txt) compiles this file with FORKATTN_TEST_STANDALONE: the
 * same tests run one after another in this process; a failed cr_assert ends
 * its test, a failed cr_expect marks it failed; the exit status is 1 when any
 * failed. An optional argument selects tests whose "suite/name" contains it. */
#include <setjmp.h>
typedef struct sa_test {
  const char *suite, *name;
  void (*fn)(void);
} sa_test;
static sa_test sa_tests[32];
static int sa_ntests, sa_failed;
static jmp_buf sa_jmp;
#define Test(suite, name, ...)                                                              \
  static void suite##_##name(void);                                                         \
  __attribute__((constructor)) static void sa_register_##suite##_##name(void) {             \
    if (sa_ntests < (int)(sizeof sa_tests / sizeof sa_tests[0]))                            \
      sa_tests[sa_ntests++] = (sa_test){#suite, #name, suite##_##name};                     \
  }                                                                                         \
  static void suite##_##name(void)
#define SA_REPORT(what, ...)                                                                \
  do {                                                                                      \
    fprintf(stderr, "%s:%d: %s: ", __FILE__, __LINE__, what);                               \
    fprintf(stderr, __VA_ARGS__);                                                           \
    fputc('\n', stderr);                                                                    \
  } while (0)
#define cr_assert(cond, ...)                                                                \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      SA_REPORT("assertion failed", __VA_ARGS__);                                           \
      longjmp(sa_jmp, 1);                                                                   \
    }                                                                                       \
  } while (0)
#define cr_expect(cond, ...)                                                                \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      SA_REPORT("expectation failed", __VA_ARGS__);                                         \
      sa_failed = 1;                                                                        \
    }                                                                                       \
  } while (0)
#define cr_assert_eq(a, b, ...) cr_assert((a) == (b), __VA_ARGS__)
#define cr_expect_eq(a, b, ...) cr_expect((a) == (b), __VA_ARGS__)
#define cr_assert_not_null(p, ...) cr_assert((p) != NULL, __VA_ARGS__)
#define cr_skip_test(...)                                                                   \
  do {                                                                                      \
    SA_REPORT("skipped", __VA_ARGS__);                                                      \
    longjmp(sa_jmp, 2);                                                                     \
  } while (0)

int main(int argc, char **argv) {
  int failed = 0, ran = 0;
  for (int i = 0; i < sa_ntests; i++) {
    char id[128];
    snprintf(id, sizeof id, "%s/%s", sa_tests[i].suite, sa_tests[i].name);
    if (argc > 1 && !strstr(id, argv[1])) continue;
    fprintf(stderr, "[RUN ] %s\n", id);
    sa_failed = 0;
    double t0 = tc_now();
    int jumped = setjmp(sa_jmp);
    if (!jumped) sa_tests[i].fn();
    const char *res = jumped == 2 ? "SKIP" : jumped == 1 || sa_failed ? "FAIL" : "PASS";
    failed += res[0] == 'F';
    ran++;
    fprintf(stderr, "[%s] %s (%.2f s)\n", res, id, tc_now() - t0);
  }
  fprintf(stderr, "[====] %d tests, %d failed (standalone runner, %s)\n", ran, failed, __FILE__);
  return failed ? 1 : 0;
}
#endif
#endif /* FORKATTN_TESTS_RUNNER_H */
