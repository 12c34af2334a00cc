/* The struct_size check of the public option structs (include/forkattn.h, ABI
 * rules): a caller that did not fill its struct with the _init function, or
 * that was compiled against a header this library does not know, is refused
 * before any field is read. */
#ifndef FA_STRUCT_SIZE_H
#define FA_STRUCT_SIZE_H

#include <stddef.h>

#include "forkattn.h"

/* FORKATTN_OK when @p given is a struct_size this library accepts for the
 * struct @p type whose size here is @p size; otherwise
 * FORKATTN_ERR_INVALID_ARGUMENT with the reason, naming type's _init
 * function, in msg[len] after "@p arg.struct_size: ". Only the current size is
 * known: a release that appends fields accepts the earlier 1.x sizes as well
 * and gives the fields those lack their defaults. */
forkattn_status fa_struct_size_check(const char *arg, size_t given, size_t size, const char *type, char *msg,
                                     size_t len);

/* fa_struct_size_check() with the message stored in the context. */
forkattn_status fa_struct_size_fail(forkattn_ctx *ctx, const char *arg, size_t given, size_t size, const char *type);

/* Check the struct_size of the option struct *p (type name @p type) of argument @p arg. */
#define FA_CHECK_STRUCT_SIZE(ctx, arg, p, type) fa_struct_size_fail((ctx), (arg), (p)->struct_size, sizeof *(p), type)

#endif
