/* JSON lines of the command-line tools. */
#ifndef FORKATTN_TOOLS_JSON_OUT_H
#define FORKATTN_TOOLS_JSON_OUT_H

/* printf to stdout for (part of) a JSON line, with every number printf wrote
 * as nan or inf (a ratio of empty or untimed runs, say) replaced by null:
 * JSON has no non-finite numbers, and a reader would reject the whole line.
 * Text inside JSON strings is left alone. A call must not split a string or
 * a number. */
void tool_json_printf(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

#endif
