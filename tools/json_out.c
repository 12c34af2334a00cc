/* JSON lines of the command-line tools: non-finite numbers become null. */
#define _POSIX_C_SOURCE 200809L /* strncasecmp */
#include "json_out.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Length of a non-finite number printf wrote at s ("nan", "-nan", "inf",
 * "-inf", "infinity", any case, "nan(...)"), or 0. */
static size_t tj_nonfinite(const char *s) {
  size_t i = (*s == '-' || *s == '+') ? 1 : 0;
  if (!strncasecmp(s + i, "infinity", 8)) return i + 8;
  if (!strncasecmp(s + i, "inf", 3)) return i + 3;
  if (strncasecmp(s + i, "nan", 3)) return 0;
  i += 3;
  if (s[i] == '(') {
    const char *close = strchr(s + i, ')');
    if (close) i = (size_t)(close - s) + 1;
  }
  return i;
}

void tool_json_printf(const char *fmt, ...) {
  char small[1024], *text = small;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(small, sizeof small, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n >= sizeof small) {
    if (!(text = malloc((size_t)n + 1))) return;
    va_start(ap, fmt);
    vsnprintf(text, (size_t)n + 1, fmt, ap);
    va_end(ap);
  }
  /* a value starts the text or follows ':', ',' or '[' outside a string */
  int in_string = 0, value_next = 1;
  for (const char *p = text; *p;) {
    if (in_string) {
      if (*p == '\\' && p[1]) putchar(*p++); /* an escape: the next character is literal */
      else if (*p == '"') in_string = 0;
      putchar(*p++);
      continue;
    }
    if (value_next && !isspace((unsigned char)*p)) {
      const size_t len = tj_nonfinite(p);
      const char after = p[len];
      if (len && (after == '\0' || after == ',' || after == '}' || after == ']' || isspace((unsigned char)after))) {
        fputs("null", stdout);
        p += len;
        value_next = 0;
        continue;
      }
    }
    if (*p == '"') in_string = 1;
    if (!isspace((unsigned char)*p)) value_next = *p == ':' || *p == ',' || *p == '[';
    putchar(*p++);
  }
  if (text != small) free(text);
}
