/* The struct_size check of the public option structs. */
#include "struct_size.h"

#include <stdio.h>

#include "context_internal.h"

forkattn_status fa_struct_size_check(const char *arg, size_t given, size_t size, const char *type, char *msg,
                                     size_t len) {
  if (given == size) return FORKATTN_OK;
  if (given == 0)
    snprintf(msg, len, "%s.struct_size: 0, the %s was not initialized: call %s_init() first", arg, type, type);
  else
    snprintf(msg, len,
             "%s.struct_size: %zu is not the size of %s this library knows (%zu): fill it with %s_init() and "
             "build against this library's forkattn.h",
             arg, given, type, size, type);
  return FORKATTN_ERR_INVALID_ARGUMENT;
}

forkattn_status fa_struct_size_fail(forkattn_ctx *ctx, const char *arg, size_t given, size_t size, const char *type) {
  char msg[FA_MSG_LEN];
  forkattn_status st = fa_struct_size_check(arg, given, size, type, msg, sizeof msg);
  return st ? fa_fail(ctx, st, "%s", msg) : st;
}
