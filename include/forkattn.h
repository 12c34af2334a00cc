/**
 * @file forkattn.h
 * @brief forkattn: attention primitives for RL post-training with shared prefixes.
 *
 * The stable public header, C11, usable from C and C++. Experimental APIs (the
 * tree cost model, partitioning and batch planning, the reuse-depth profile)
 * are in forkattn_experimental.h, outside the promise below.
 *
 * ABI rules (hold for every 1.x release):
 *  - Option structs (::forkattn_ctx_options, ::forkattn_kl_options,
 *    ::forkattn_kv_cache_options, ::forkattn_kv_policy) start with
 *    `size_t struct_size`, which their _init function sets: always fill one
 *    with its _init function, then set the fields you need. The library
 *    refuses a struct_size of 0 or one it does not know with
 *    ::FORKATTN_ERR_INVALID_ARGUMENT (the message names the _init function).
 *    New fields are only appended; a later 1.x library accepts the
 *    struct_size of every earlier 1.x header and gives the fields that
 *    header lacks their defaults.
 *  - Plain data descriptors (::forkattn_tensor, ::forkattn_prefix_layout,
 *    ::forkattn_tree_layout, ::forkattn_layout, ::forkattn_kept_set,
 *    ::forkattn_kv_cache_stats) have no size field: their layout is fixed for
 *    1.x.
 *  - No function returns a struct by value: structs come back through an
 *    output pointer (forkattn_tensor_contiguous() is an inline helper of this
 *    header, not a library symbol).
 *  - Enum values and status codes are fixed; new ones are only appended.
 *
 * Conventions (hold for every function below):
 *  - Every call returns ::forkattn_status. Bad input returns
 *    ::FORKATTN_ERR_INVALID_ARGUMENT and stores a message retrievable with
 *    forkattn_ctx_last_error(); nothing aborts, nothing is written outside the
 *    given outputs, and outputs are left untouched on any error detected before
 *    computation starts (all argument errors are).
 *  - Tensors are described by ::forkattn_tensor: pointer, dtype, int64 sizes and
 *    element strides. Compute is always float32 whatever the storage dtype.
 *  - Attention state contract (FlashInfer's merge_state, but natural log):
 *    a row's result is the pair (o, lse) with lse = log(sum_j exp(s_j)) in base e
 *    over the keys the row may see (s_j already scaled). A row that sees no key
 *    (empty set) has o = 0 and lse = -inf, never NaN.
 *  - A context is not thread-safe: use one per thread.
 */
#ifndef FORKATTN_H
#define FORKATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** @name Version */
/**@{*/
/** Major version: incompatible API or ABI changes. */
#define FORKATTN_VERSION_MAJOR 0
/** Minor version: additions. */
#define FORKATTN_VERSION_MINOR 2
/** Patch version: fixes. */
#define FORKATTN_VERSION_PATCH 0
/** MAJOR*10000 + MINOR*100 + PATCH, as returned by forkattn_version_number(). */
#define FORKATTN_VERSION_NUMBER \
  (FORKATTN_VERSION_MAJOR * 10000 + FORKATTN_VERSION_MINOR * 100 + FORKATTN_VERSION_PATCH)
/**@}*/

/** @def FORKATTN_API
 *  Marks the library's exported symbols (define FORKATTN_STATIC when linking the static library). */
#if defined(_WIN32) && defined(FORKATTN_BUILDING_DLL)
#define FORKATTN_API __declspec(dllexport)
#elif defined(__GNUC__) && !defined(FORKATTN_STATIC)
#define FORKATTN_API __attribute__((visibility("default")))
#else
#define FORKATTN_API
#endif

/** Status of every call. Values are fixed; new ones are only appended. */
typedef enum forkattn_status {
  FORKATTN_OK = 0,                      /**< success */
  FORKATTN_ERR_INVALID_ARGUMENT = 1,    /**< bad input; see forkattn_ctx_last_error() */
  FORKATTN_ERR_OUT_OF_MEMORY = 2,       /**< host or device allocation failed */
  FORKATTN_ERR_UNSUPPORTED = 3,         /**< valid request this build/backend cannot do */
  FORKATTN_ERR_BACKEND_UNAVAILABLE = 4, /**< requested backend absent (e.g. gpu without device) */
  FORKATTN_ERR_DEVICE = 5,              /**< device runtime failure (copy, launch) */
  FORKATTN_ERR_INTERNAL = 6             /**< bug: please report */
} forkattn_status;

/** Compute backend of a context. */
typedef enum forkattn_backend {
  FORKATTN_BACKEND_AUTO = 0, /**< GPU when a device exists and our image runs on it, else CPU */
  FORKATTN_BACKEND_CPU = 1,  /**< vectorized CPU kernels (always available) */
  FORKATTN_BACKEND_GPU = 2   /**< OpenMP offload kernels (offload builds only) */
} forkattn_backend;

/** Storage type of tensor elements. Values fixed; new ones only appended. */
typedef enum forkattn_dtype {
  FORKATTN_DTYPE_F32 = 0,  /**< IEEE binary32 */
  FORKATTN_DTYPE_BF16 = 1, /**< bfloat16 (upper half of binary32) */
  FORKATTN_DTYPE_F16 = 2   /**< IEEE binary16 */
} forkattn_dtype;

/** Where the data pointers of one call live (GPU backend only; CPU needs host). */
typedef enum forkattn_memory {
  FORKATTN_MEMORY_HOST = 0,  /**< host memory: the GPU backend copies in and out */
  FORKATTN_MEMORY_DEVICE = 1 /**< device memory of the context's device (e.g. torch CUDA data_ptr()) */
} forkattn_memory;

/**
 * A strided 3-D tensor [rows, heads, head_dim]; element (r, h, c) is at
 * data + r*row_stride + h*head_stride + c (in elements, not bytes).
 * The head_dim axis is contiguous. Strides must be positive and describe
 * either heads inside rows (head_stride >= head_dim and row_stride >= the
 * extent of one row's heads: row-major, possibly padded) or rows inside heads
 * (row_stride >= head_dim and head_stride >= the extent of one head's rows:
 * head-major). Anything else, overlapping or exotically interleaved, is
 * refused with FORKATTN_ERR_INVALID_ARGUMENT.
 *
 * Alignment: data must be a multiple of the element size (4 bytes for f32, 2
 * for bf16 and f16), or the call is refused with FORKATTN_ERR_INVALID_ARGUMENT
 * naming the tensor (a misaligned load is undefined behaviour in C). The same
 * holds for every other typed array the API reads or writes: float lse, stats
 * and similarity arrays (4 bytes), int64_t offsets, parents and index arrays
 * (8), double outputs (8), int32_t tokens (4). Nothing stronger is required:
 * the GPU tensor-core kernels that want 16-byte rows fall back to other
 * kernels when the rows are not.
 */
typedef struct forkattn_tensor {
  void *data;            /**< first element (element-aligned); host or device pointer per ::forkattn_memory */
  forkattn_dtype dtype;  /**< storage type */
  int64_t rows;          /**< number of token rows */
  int64_t heads;         /**< number of heads */
  int64_t head_dim;      /**< elements per head vector (1..256) */
  int64_t row_stride;    /**< elements between consecutive rows */
  int64_t head_stride;   /**< elements between consecutive heads */
} forkattn_tensor;

/**
 * Describe a contiguous [rows, heads, head_dim] tensor
 * (row_stride = heads*head_dim, head_stride = head_dim). If heads*head_dim
 * overflows int64, row_stride is 0 and every call refuses the descriptor.
 * Checks nothing else (calls validate descriptors). An inline function of this
 * header: no library call.
 * @param data first element (host or device pointer)
 * @param dtype storage type
 * @param rows number of rows
 * @param heads number of heads
 * @param head_dim elements per head vector
 * @return the descriptor
 */
static inline forkattn_tensor forkattn_tensor_contiguous(void *data, forkattn_dtype dtype, int64_t rows,
                                                         int64_t heads, int64_t head_dim) {
  forkattn_tensor t;
  t.data = data;
  t.dtype = dtype;
  t.rows = rows;
  t.heads = heads;
  t.head_dim = head_dim;
  /* the signed-overflow test of heads * head_dim for every sign combination */
  const int overflow = heads > 0 ? (head_dim > 0 ? heads > INT64_MAX / head_dim : head_dim < INT64_MIN / heads)
                                 : (head_dim > 0 ? heads < INT64_MIN / head_dim
                                                 : (heads != 0 && head_dim < INT64_MAX / heads));
  t.row_stride = overflow ? 0 : heads * head_dim;
  t.head_stride = head_dim;
  return t;
}

/** @name Version and status */
/**@{*/
/** @return FORKATTN_VERSION_NUMBER of the library actually linked. */
FORKATTN_API unsigned forkattn_version_number(void);
/** @return "MAJOR.MINOR.PATCH" of the library actually linked (static storage). */
FORKATTN_API const char *forkattn_version_string(void);
/** @param status any value (unknown ones included)
 *  @return static English name of the status ("invalid argument", ...); never NULL */
FORKATTN_API const char *forkattn_status_string(forkattn_status status);
/** @param backend any value (unknown ones included)
 *  @return static lower-case name ("auto", "cpu", "gpu", "unknown"); never NULL */
FORKATTN_API const char *forkattn_backend_name(forkattn_backend backend);
/** @return non-zero when the library was built with GPU offload support */
FORKATTN_API int forkattn_build_has_offload(void);
/**@}*/

/** @name Context */
/**@{*/
/** Opaque context: backend, device, threads, last error, workspace. */
typedef struct forkattn_ctx forkattn_ctx;

/** Kernel families a GPU context may use (forkattn_ctx_options.gpu_kernels). Each call runs
 *  the fastest family allowed that its shape and the device support: the wgmma kernels
 *  (sm_90a builds; bf16/f16, head_dim 64 or 128, no kept set, 16-byte rows, team memory past
 *  48 KB, tensor maps the driver encodes), else the mma.sync tensor-core kernels (the same
 *  shapes), else the FP32 kernels (every call). `forkattn info` and forkattn_ctx_gpu_kernels()
 *  say which family each pass gets. */
typedef enum forkattn_gpu_kernels {
  FORKATTN_GPU_KERNELS_AUTO = 0, /**< the fastest the build, device and call allow (default) */
  FORKATTN_GPU_KERNELS_MMA = 1,  /**< no wgmma: mma.sync tensor-core kernels where a call fits them */
  FORKATTN_GPU_KERNELS_FP32 = 2  /**< the FP32 CUDA-core kernels only */
} forkattn_gpu_kernels;

/** How a GPU context multiplies f32 inputs (forkattn_ctx_options.f32_precision), after PyTorch's
 *  torch.set_float32_matmul_precision. Sums and the softmax are f32 in every mode; CPU contexts
 *  always multiply in f32. Attention and StreamKL, forward and backward, at head_dim 64 or 128
 *  without a kept set have tensor-core kernels for f32 inputs (StreamKL: one head_dim on both sides,
 *  one KV head count for its backward); every other f32 call runs the FP32 kernels whatever the mode.
 *  Error bounds and measurements: docs/numerics.md "f32 on tensor cores". */
typedef enum forkattn_f32_precision {
  FORKATTN_F32_PRECISION_HIGH = 0,    /**< f32 values as sums of three bf16 pieces, each product
                                           as six bf16 tensor-core products (bf16x6, ~2^-24
                                           relative): float32-level errors, within the f32 test
                                           tolerances (default) */
  FORKATTN_F32_PRECISION_HIGHEST = 1, /**< f32 products on CUDA cores (the FP32 kernels) */
  FORKATTN_F32_PRECISION_MEDIUM = 2   /**< every operand in two bf16 pieces, three products
                                           (bf16x3, ~2^-16 relative: finer than TF32's 2^-11);
                                           faster than HIGH, looser on large logits */
} forkattn_f32_precision;

/** Options for forkattn_ctx_create(). Initialize with forkattn_ctx_options_init(). */
typedef struct forkattn_ctx_options {
  size_t struct_size;       /**< sizeof(forkattn_ctx_options), set by forkattn_ctx_options_init() */
  forkattn_backend backend; /**< requested backend; with AUTO, the FORKATTN_BACKEND env var
                                 may choose it (an explicit CPU or GPU stands) */
  int device;               /**< OpenMP device number for the GPU backend (default 0) */
  int threads;              /**< CPU threads; 0 = one per physical core (hwloc); at most
                                 forkattn_max_threads() */
  int bind_threads;         /**< non-zero: pin CPU worker threads to cores (hwloc) during a
                                 call; previous affinities are restored when it returns */
  int verbose;              /**< non-zero: log the backend decision to stderr and, on a GPU
                                 context, the kernels each call runs and how its
                                 forward and dQ work is scheduled, with why */
  forkattn_gpu_kernels gpu_kernels; /**< GPU contexts: the kernel families allowed (default
                                         AUTO); FORKATTN_GPU_KERNELS=auto|mma|fp32 overrides it */
  int gpu_persist;          /**< GPU contexts: the wgmma two-warpgroup forward and dQ as
                                 persistent teams (one an SM taking items from a counter), or
                                 the forward as stream teams (one an SM running a fixed share of
                                 the items, the next item's tiles loading under the current one):
                                 -1 automatic (default: persistent teams from 8 items an SM that
                                 see 1024 keys or more on average, stream teams from 2 items an SM
                                 for shorter items), 0 never, 1 always persistent, n > 1 always
                                 persistent with at most n teams (at most 2^20), -2 always stream
                                 teams in the forward; FORKATTN_GPU_PERSIST=auto|0|1|n|stream
                                 overrides it */
  forkattn_f32_precision f32_precision; /**< GPU contexts: how f32 inputs are multiplied (default
                                             HIGH); FORKATTN_F32_PRECISION=high|highest|medium
                                             overrides it */
} forkattn_ctx_options;

/** Fill @p opt with defaults: struct_size, auto backend, device 0, threads 0, no
 *  binding, quiet, GPU kernels AUTO, gpu_persist -1, f32_precision HIGH.
 *  @param opt options to initialize (NULL is ignored) */
FORKATTN_API void forkattn_ctx_options_init(forkattn_ctx_options *opt);

/**
 * Create a context. @p opt may be NULL (defaults). When opt->backend is
 * FORKATTN_BACKEND_AUTO, the environment variable FORKATTN_BACKEND=cpu|gpu|auto
 * chooses the backend instead (an unknown value is an error); a backend the
 * options name explicitly (CPU or GPU) is used whatever the environment says,
 * and the variable is not read. With auto, the GPU is chosen only when the
 * build has offload, a device exists and a probe kernel from our device image
 * really runs on it; otherwise the CPU, and forkattn_ctx_backend_reason()
 * says why.
 * A GPU context reads its kernel choice (opt->gpu_kernels, opt->gpu_persist and their
 * environment variables) here, once; its calls never read the environment.
 * Requesting gpu when it is unavailable returns FORKATTN_ERR_BACKEND_UNAVAILABLE
 * (and *ctx = NULL); forkattn_ctx_create_error() then says why. Nothing is
 * printed unless opt->verbose is set.
 * opt->threads must lie in 0..forkattn_max_threads(): every CPU call opens an
 * OpenMP team of that many threads, and the OpenMP runtime ends the process
 * when it cannot create one, so absurd counts are refused here instead.
 * @param[out] ctx receives the new context, or NULL on failure.
 * @param opt options, or NULL for the defaults (copied; not kept)
 * @return FORKATTN_OK, FORKATTN_ERR_INVALID_ARGUMENT (bad options or a
 *         struct_size this library does not know, threads above
 *         forkattn_max_threads(), or a bad FORKATTN_BACKEND value with an auto
 *         request; on a GPU context also a bad FORKATTN_GPU_KERNELS or
 *         FORKATTN_GPU_PERSIST value),
 *         FORKATTN_ERR_BACKEND_UNAVAILABLE or FORKATTN_ERR_OUT_OF_MEMORY
 */
FORKATTN_API forkattn_status forkattn_ctx_create(forkattn_ctx **ctx,
                                                 const forkattn_ctx_options *opt);
/** The largest forkattn_ctx_options.threads that forkattn_ctx_create() accepts
 *  on this machine: the larger of 64 and 4 x the hardware threads (PUs) that
 *  hwloc reports for this process (omp_get_num_procs() when hwloc fails).
 *  @return the limit (>= 64) */
FORKATTN_API int forkattn_max_threads(void);
/** @return why the calling thread's last forkattn_ctx_create() failed ("" after a
 *  success); thread-local static storage */
FORKATTN_API const char *forkattn_ctx_create_error(void);
/** Destroy a context. A GPU context keeps the device scratch of its calls (plan
 *  arrays, partial sums, device copies of host tensors) cached for the next call;
 *  destroying it frees that memory.
 *  @param ctx the context (NULL is allowed) */
FORKATTN_API void forkattn_ctx_destroy(forkattn_ctx *ctx);
/** @param ctx the context
 *  @return the backend the context really uses (CPU or GPU, never AUTO) */
FORKATTN_API forkattn_backend forkattn_ctx_backend(const forkattn_ctx *ctx);
/** @param ctx the context
 *  @return one line saying why that backend was chosen; owned by the context */
FORKATTN_API const char *forkattn_ctx_backend_reason(const forkattn_ctx *ctx);
/** @param ctx the context
 *  @return one line naming the kernel family each GPU pass (forward, dQ, dK/dV, StreamKL
 *  forward and backward) runs for bf16/f16 calls at head_dim 64 and 128 with 16-byte rows,
 *  and the persistent-teams choice; "" on a CPU context. Owned by the context. */
FORKATTN_API const char *forkattn_ctx_gpu_kernels(const forkattn_ctx *ctx);
/** @param ctx the context
 *  @return the number of threads the CPU kernels use */
FORKATTN_API int forkattn_ctx_threads(const forkattn_ctx *ctx);
/** @param ctx the context
 *  @return the message of the last failed call on this context ("" if none); owned by it */
FORKATTN_API const char *forkattn_ctx_last_error(const forkattn_ctx *ctx);
/** @param ctx the context
 *  @return the largest scratch memory (bytes, host or device) one call of this
 *  context has allocated so far: what the library adds to the caller's memory.
 *  The caller's tensors are excluded, but device copies the GPU backend makes
 *  of host tensors (FORKATTN_MEMORY_HOST) are included. A GPU context caches
 *  these blocks between calls (freed by forkattn_ctx_destroy()), so the device
 *  memory it holds can exceed one call's peak by blocks of differently sized
 *  earlier calls. */
FORKATTN_API size_t forkattn_ctx_peak_workspace(const forkattn_ctx *ctx);
/**@}*/

/** @name Streams (GPU backend)
 *  By default a GPU call returns once its results are in place, and it is not
 *  ordered with the caller's own CUDA work (synchronize before the call). A
 *  context given a CUDA stream orders its calls on that stream instead, and
 *  its attention calls on device memory return as soon as their kernels are
 *  queued, as a CUDA library's calls do. */
/**@{*/
/**
 * Order this context's GPU calls on a CUDA stream.
 *
 * From now on a forward or backward attention call (prefix or tree) on
 * device memory (FORKATTN_MEMORY_DEVICE) that runs the tensor-core kernels
 * (bf16 or f16, head_dim 64 or 128, no kept-set mask) queues its kernels,
 * and the copy of its plan, on @p stream and returns without waiting. Its
 * outputs are ready when the stream reaches that point (read them on the
 * stream, or after forkattn_ctx_synchronize()); its device inputs must stay
 * unchanged until then. The host arrays of its arguments (layouts, tensor
 * descriptors) may be reused as soon as it returns.
 *
 * Every other call on the context (host memory, f32, the FP32 kernels,
 * StreamKL, forkattn_memcpy(), forkattn_device_free(), the KV cache, ...)
 * first waits for the stream, then runs as it does without one: it sees the
 * queued calls' results and returns with its own in place. Bad arguments are
 * still reported by the call that got them; a fault of a queued kernel is
 * reported (FORKATTN_ERR_DEVICE) by the next call that waits for the stream.
 * The context's scratch memory is reused in stream order: use a context
 * from one stream, and one thread, at a time.
 *
 * While @p stream is being captured into a CUDA graph, a queued call is
 * recorded (only its kernels; its plan is uploaded during the call and its
 * device memory stays allocated until the context is destroyed, so destroy
 * it after its graphs) and every other call returns
 * FORKATTN_ERR_UNSUPPORTED. Setting, clearing and synchronizing do not wait
 * for a stream that is being captured.
 *
 * @param ctx a GPU context
 * @param stream a CUstream (cudaStream_t) of the device's primary context,
 *        cast to a pointer: the CUDA runtime's streams and PyTorch's
 *        (`torch.cuda.current_stream().cuda_stream`) are; NULL is CUDA's
 *        legacy default stream. A stream set before is waited for first.
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT (ctx NULL, not a live
 *         stream, or a stream of another CUDA context);
 *         FORKATTN_ERR_BACKEND_UNAVAILABLE (a CPU context);
 *         FORKATTN_ERR_UNSUPPORTED (this offload runtime's launches cannot be
 *         routed to a stream); FORKATTN_ERR_DEVICE (waiting for the previous
 *         stream failed). forkattn_ctx_last_error() says why.
 */
FORKATTN_API forkattn_status forkattn_ctx_set_stream(forkattn_ctx *ctx, void *stream);
/** Wait for the context's stream, then make its calls synchronous again
 *  (the default). A context without a stream is left as it is.
 *  @param ctx the context
 *  @return FORKATTN_OK, FORKATTN_ERR_INVALID_ARGUMENT (ctx NULL) or
 *          FORKATTN_ERR_DEVICE (as forkattn_ctx_synchronize()); the stream is
 *          cleared either way */
FORKATTN_API forkattn_status forkattn_ctx_clear_stream(forkattn_ctx *ctx);
/** Wait until everything queued on the context's stream has finished (at
 *  once for a context without a stream).
 *  @param ctx the context
 *  @return FORKATTN_OK, FORKATTN_ERR_INVALID_ARGUMENT (ctx NULL) or
 *          FORKATTN_ERR_DEVICE (a queued kernel failed, or the wait did) */
FORKATTN_API forkattn_status forkattn_ctx_synchronize(forkattn_ctx *ctx);
/**@}*/

/** @name Device memory (GPU backend; CPU contexts return FORKATTN_ERR_BACKEND_UNAVAILABLE) */
/**@{*/
/** Allocate device memory on the context's device.
 *  @param ctx a GPU context
 *  @param bytes size (0 allocates a minimal block)
 *  @param[out] ptr receives the device pointer (NULL on failure)
 *  @return FORKATTN_OK, FORKATTN_ERR_BACKEND_UNAVAILABLE (CPU context),
 *          FORKATTN_ERR_INVALID_ARGUMENT or FORKATTN_ERR_OUT_OF_MEMORY */
FORKATTN_API forkattn_status forkattn_device_malloc(forkattn_ctx *ctx, size_t bytes, void **ptr);
/** Free memory from forkattn_device_malloc().
 *  @param ctx the GPU context that allocated it
 *  @param ptr the device pointer (NULL is allowed)
 *  @return FORKATTN_OK or FORKATTN_ERR_BACKEND_UNAVAILABLE (CPU context) */
FORKATTN_API forkattn_status forkattn_device_free(forkattn_ctx *ctx, void *ptr);
/** Copy between host and device memory of the context's device, any direction
 *  (host to host works on any context).
 *  @param ctx the context
 *  @param dst destination
 *  @param dst_memory where dst lives
 *  @param src source
 *  @param src_memory where src lives
 *  @param bytes bytes to copy
 *  @return FORKATTN_OK, FORKATTN_ERR_INVALID_ARGUMENT, FORKATTN_ERR_BACKEND_UNAVAILABLE
 *          (device memory on a CPU context) or FORKATTN_ERR_DEVICE */
FORKATTN_API forkattn_status forkattn_memcpy(forkattn_ctx *ctx, void *dst, forkattn_memory dst_memory,
                                             const void *src, forkattn_memory src_memory,
                                             size_t bytes);
/**@}*/

/** @name Shared-prompt attention (DualKV) */
/**@{*/

/** Attention mask of a shared-prompt group. */
typedef enum forkattn_mask {
  /** Autoregressive: the prompt attends causally to itself; response i attends
   *  to the whole prompt and causally to itself. */
  FORKATTN_MASK_CAUSAL = 0,
  /** Diffusion LMs: the prompt attends to the whole prompt; response i attends
   *  to the whole prompt and to all of response i. */
  FORKATTN_MASK_BIDIRECTIONAL = 1
} forkattn_mask;

/**
 * Packed layout of one shared-prompt group: rows [0, prompt_len) hold the
 * prompt, then response i occupies rows
 * [prompt_len + response_offsets[i], prompt_len + response_offsets[i+1]).
 * response_offsets has num_responses+1 non-decreasing entries starting at 0
 * (CSR); lengths may be 0. prompt_len = 0 gives plain variable-length attention.
 * Total rows = prompt_len + response_offsets[num_responses]; q, k, v (and every
 * output) must have exactly that many rows.
 * response_offsets is always a host pointer.
 */
typedef struct forkattn_prefix_layout {
  int64_t prompt_len;               /**< P >= 0 */
  int64_t num_responses;            /**< N >= 0 */
  const int64_t *response_offsets;  /**< host array of N+1 entries; may be NULL when N = 0 */
  forkattn_mask mask;               /**< causal or bidirectional */
} forkattn_prefix_layout;

/**
 * Forward shared-prompt attention. Hq must be a multiple of Hkv (GQA: query
 * head h reads KV head h / (Hq/Hkv)); all tensors share one dtype.
 *
 * @param ctx the context (its backend runs the call)
 * @param layout the packed group (host memory)
 * @param q queries [T, Hq, d]
 * @param k keys [T, Hkv, d]
 * @param v values [T, Hkv, d]
 * @param o output [T, Hq, d], overwritten
 * @param lse optional (NULL to skip) float32 [T, Hq] row-major: natural log of
 *        the softmax denominator of the scaled scores (needed by forkattn_prefix_bwd())
 * @param scale softmax scale applied to q.k (1/sqrt(d) for the usual one; finite
 *        and > 0). Scores that overflow f32 (|scale * q.k| > 3.4e38) make the rows
 *        that see them NaN.
 * @param memory where q, k, v, o, lse live (FORKATTN_MEMORY_DEVICE needs the GPU backend)
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT (outputs untouched, message in
 *         forkattn_ctx_last_error()); FORKATTN_ERR_OUT_OF_MEMORY; FORKATTN_ERR_UNSUPPORTED;
 *         FORKATTN_ERR_DEVICE
 */
FORKATTN_API forkattn_status forkattn_prefix_fwd(forkattn_ctx *ctx,
                                                 const forkattn_prefix_layout *layout,
                                                 const forkattn_tensor *q,
                                                 const forkattn_tensor *k,
                                                 const forkattn_tensor *v,
                                                 const forkattn_tensor *o, float *lse,
                                                 float scale, forkattn_memory memory);

/**
 * Backward of forkattn_prefix_fwd(): gradients of sum(o * dout) with respect to
 * q, k, v. The prompt's dk/dv is its own part plus the sum over all responses
 * that read it: identical to the replicated batch with the prompt copies'
 * gradients summed. Outputs are overwritten (not accumulated); deterministic
 * (no floating-point atomics). All tensors share one dtype.
 * o enters only through D = rowsum(dout * o). With bf16/f16 tensors, rows whose
 * query block sees at most 16 keys take D from q, k, v, dout and lse instead
 * (sum_j exp(s_j - lse) dout . v_j): on so few keys the rounding of a 16-bit o
 * would dominate their gradients (docs/numerics.md). The same holds for every
 * attention backward of this header without a kept set.
 *
 * @param ctx the context
 * @param layout the packed group (host memory), as in the forward
 * @param q queries [T, Hq, d]
 * @param k keys [T, Hkv, d]
 * @param v values [T, Hkv, d]
 * @param o the forward's output [T, Hq, d]
 * @param dout gradient of the loss with respect to o [T, Hq, d]
 * @param lse float32 [T, Hq] from the forward with the same scale (required)
 * @param dq output [T, Hq, d]
 * @param dk output [T, Hkv, d]
 * @param dv output [T, Hkv, d]
 * @param scale the forward's softmax scale
 * @param memory where every tensor and lse live
 * @return as forkattn_prefix_fwd()
 */
FORKATTN_API forkattn_status forkattn_prefix_bwd(forkattn_ctx *ctx,
                                                 const forkattn_prefix_layout *layout,
                                                 const forkattn_tensor *q,
                                                 const forkattn_tensor *k,
                                                 const forkattn_tensor *v,
                                                 const forkattn_tensor *o,
                                                 const forkattn_tensor *dout,
                                                 const float *lse,
                                                 const forkattn_tensor *dq,
                                                 const forkattn_tensor *dk,
                                                 const forkattn_tensor *dv, float scale,
                                                 forkattn_memory memory);
/**@}*/

/** @name Tree attention
 * Rollouts that branch many times form a tree (a trie of token sequences).
 * Rows are packed once; node i owns the contiguous rows
 * [node_offsets[i], node_offsets[i+1]). A row attends to every row of every
 * ancestor node and causally within its own node. The shared-prompt layout is
 * the tree of depth one (a root prompt and one child per response). */
/**@{*/

/** A packed tree of segments (all arrays in host memory). */
typedef struct forkattn_tree_layout {
  int64_t num_nodes;            /**< n >= 0 */
  const int64_t *node_offsets;  /**< n+1 entries, node_offsets[0] = 0, non-decreasing
                                     (empty nodes allowed); NULL only when n = 0 */
  const int64_t *parents;       /**< n entries: -1 for a root, else a node index < i
                                     (parents are packed before their children, as in
                                     DFS or BFS order); NULL only when n = 0 */
} forkattn_tree_layout;

/**
 * Forward tree attention: row r of node i attends to all rows of i's ancestors
 * and to rows r' <= r of node i. Several roots (a forest) are independent
 * trees packed one after another. Same tensor conventions as
 * forkattn_prefix_fwd() with T = node_offsets[n].
 *
 * @param ctx the context
 * @param tree the packed tree (host memory)
 * @param q queries [T, Hq, d]
 * @param k keys [T, Hkv, d]
 * @param v values [T, Hkv, d]
 * @param o output [T, Hq, d], overwritten
 * @param lse optional float32 [T, Hq] natural-log softmax denominators (NULL to skip)
 * @param scale softmax scale (finite, > 0)
 * @param memory where q, k, v, o, lse live
 * @return as forkattn_prefix_fwd()
 */
FORKATTN_API forkattn_status forkattn_tree_fwd(forkattn_ctx *ctx, const forkattn_tree_layout *tree,
                                               const forkattn_tensor *q, const forkattn_tensor *k,
                                               const forkattn_tensor *v, const forkattn_tensor *o,
                                               float *lse, float scale, forkattn_memory memory);

/**
 * Backward of forkattn_tree_fwd(). The dk/dv of a node is the sum over every
 * descendant row that read it (and its own rows): identical to running each
 * root-to-leaf sequence separately and summing the copies' gradients.
 * Overwrites dq, dk, dv; deterministic (no floating-point atomics).
 *
 * @param ctx the context
 * @param tree the packed tree, as in the forward
 * @param q queries [T, Hq, d]
 * @param k keys [T, Hkv, d]
 * @param v values [T, Hkv, d]
 * @param o the forward's output [T, Hq, d]
 * @param dout gradient of the loss with respect to o [T, Hq, d]
 * @param lse float32 [T, Hq] from the forward (required)
 * @param dq output [T, Hq, d]
 * @param dk output [T, Hkv, d]
 * @param dv output [T, Hkv, d]
 * @param scale the forward's softmax scale
 * @param memory where every tensor and lse live
 * @return as forkattn_prefix_fwd()
 */
FORKATTN_API forkattn_status forkattn_tree_bwd(forkattn_ctx *ctx, const forkattn_tree_layout *tree,
                                               const forkattn_tensor *q, const forkattn_tensor *k,
                                               const forkattn_tensor *v, const forkattn_tensor *o,
                                               const forkattn_tensor *dout, const float *lse,
                                               const forkattn_tensor *dq, const forkattn_tensor *dk,
                                               const forkattn_tensor *dv, float scale,
                                               forkattn_memory memory);
/**@}*/

/** @name DFS path stack
 * Depth-first execution of a tree for frameworks that run a whole model
 * segment by segment (AReaL-DTA): only the KV of the active root-to-node path
 * is resident. Forward: push(node's k, v); attend_fwd(node's q); visit the
 * children; pop. Backward, the same walk: push; attend_bwd(node's q, dout)
 * adds the node's share of dk/dv to every node on the stack; visit the
 * children; pop(dk, dv) hands back the node's complete dk/dv (its own rows'
 * share plus every descendant's). Peak memory follows the deepest path, not
 * the tree. Host memory; any backend (the GPU backend stages each call). */
/**@{*/

/** A path stack (opaque). Bound to the context that created it; its errors are
 *  reported through forkattn_ctx_last_error() of that context. */
typedef struct forkattn_path forkattn_path;

/**
 * Create an empty path stack.
 *
 * @param ctx the context (not thread-safe: one path per context at a time)
 * @param dtype storage dtype of every tensor given to the path
 * @param heads_q query heads Hq (a multiple of heads_kv)
 * @param heads_kv KV heads Hkv
 * @param head_dim d (1..256)
 * @param path receives the stack (NULL on error)
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT; FORKATTN_ERR_OUT_OF_MEMORY
 */
FORKATTN_API forkattn_status forkattn_path_create(forkattn_ctx *ctx, forkattn_dtype dtype,
                                                  int64_t heads_q, int64_t heads_kv,
                                                  int64_t head_dim, forkattn_path **path);

/** Free a path stack (NULL is a no-op). @param path the stack */
FORKATTN_API void forkattn_path_destroy(forkattn_path *path);

/**
 * Push a node: copy its keys and values (n rows, n >= 1) on top of the stack
 * and start its dk/dv at zero. The stack grows first: a node whose rows would
 * make the stack's size overflow is refused (INVALID_ARGUMENT), and one that
 * cannot be allocated gives OUT_OF_MEMORY, in both cases before k or v is read
 * and with the stack unchanged.
 *
 * @param path the stack
 * @param k keys [n, Hkv, d]
 * @param v values [n, Hkv, d]
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT; FORKATTN_ERR_OUT_OF_MEMORY
 */
FORKATTN_API forkattn_status forkattn_path_push(forkattn_path *path, const forkattn_tensor *k,
                                                const forkattn_tensor *v);

/**
 * Attention of the top node's queries: every row sees all rows of the nodes
 * below it on the stack and, causally, its own node's rows. Equal to
 * forkattn_tree_fwd() on the tree's rows of that node.
 *
 * @param path the stack (not empty)
 * @param q queries [n, Hq, d] of the top node (n = its rows)
 * @param o output [n, Hq, d]
 * @param lse optional float32 [n, Hq] (needed by forkattn_path_attend_bwd())
 * @param scale softmax scale (finite, > 0)
 * @return as forkattn_tree_fwd()
 */
FORKATTN_API forkattn_status forkattn_path_attend_fwd(forkattn_path *path, const forkattn_tensor *q,
                                                      const forkattn_tensor *o, float *lse,
                                                      float scale);

/**
 * Backward of forkattn_path_attend_fwd() for the top node: writes dq of its
 * rows and adds their dk/dv contributions to every node on the stack.
 *
 * @param path the stack (not empty), holding the same KV as in the forward
 * @param q queries [n, Hq, d]
 * @param o the forward's output [n, Hq, d]
 * @param dout gradient of the loss with respect to o [n, Hq, d]
 * @param lse float32 [n, Hq] from the forward (required)
 * @param dq output [n, Hq, d], overwritten
 * @param scale the forward's scale
 * @return as forkattn_tree_bwd()
 */
FORKATTN_API forkattn_status forkattn_path_attend_bwd(forkattn_path *path, const forkattn_tensor *q,
                                                      const forkattn_tensor *o,
                                                      const forkattn_tensor *dout, const float *lse,
                                                      const forkattn_tensor *dq, float scale);

/**
 * Pop the top node, handing back its accumulated dk/dv: the sum of every
 * forkattn_path_attend_bwd() made while it was on the stack.
 *
 * @param path the stack (not empty)
 * @param dk output [n, Hkv, d] (n = the node's rows), or NULL to discard
 * @param dv output [n, Hkv, d], or NULL to discard
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT (nothing popped)
 */
FORKATTN_API forkattn_status forkattn_path_pop(forkattn_path *path, const forkattn_tensor *dk,
                                               const forkattn_tensor *dv);

/** @param path the stack @return nodes on the stack */
FORKATTN_API int64_t forkattn_path_depth(const forkattn_path *path);

/** @param path the stack @return rows on the stack (the active path's length) */
FORKATTN_API int64_t forkattn_path_rows(const forkattn_path *path);

/** Largest number of bytes the stack's own buffers (K, V, dK/dV accumulators
 *  and backward scratch) have held since creation.
 *  @param path the stack @return bytes */
FORKATTN_API size_t forkattn_path_peak_bytes(const forkattn_path *path);
/**@}*/

/** @name Rollout tries
 * Build the deduplicated prefix tree of a set of rollouts and the maps a
 * trainer needs to go between per-sequence tensors and packed rows. A trie is
 * an immutable object; the arrays its accessors return live as long as it
 * (accessors given NULL return 0 or NULL). Builders check every argument
 * before building, never recurse, and work on the host. */
/**@{*/

/** A built trie (opaque). */
typedef struct forkattn_trie forkattn_trie;

/** Flag for the builders: fail with FORKATTN_ERR_INVALID_ARGUMENT unless the
 *  tree has exactly one root (e.g. every rollout starts with the same prompt;
 *  for sequences: every sequence starts with the same token). */
#define FORKATTN_TRIE_SINGLE_ROOT 1u

/**
 * Build the trie of N token sequences. Each node is a maximal run of tokens
 * shared by the same set of sequences; a node also ends where a sequence ends,
 * so every sequence is exactly a root-to-node path. Identical sequences share
 * every row. Rows are packed in depth-first order (every subtree is a
 * contiguous range of nodes and of rows); a node's first child is the one
 * with the most nodes in its subtree (its rows follow the parent's, so tree
 * attention reads them as one key segment), the others, and ties, in order of
 * first appearance (the first sequence through them). Sequences whose first tokens
 * differ give a forest (several roots). Expected time O(total tokens); no
 * recursion, so any depth works.
 *
 * @param ctx the context (error messages)
 * @param num_sequences N >= 1
 * @param seq_offsets N+1 entries, seq_offsets[0] = 0, strictly increasing (empty
 *        sequences are an error)
 * @param tokens seq_offsets[N] token ids
 * @param flags 0 or ::FORKATTN_TRIE_SINGLE_ROOT
 * @param trie receives the trie (NULL on error)
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT (ctx or trie NULL, unknown
 *         flags, or bad input; the message names the argument, index and value);
 *         FORKATTN_ERR_OUT_OF_MEMORY. On error nothing stays allocated.
 */
FORKATTN_API forkattn_status forkattn_trie_from_sequences(forkattn_ctx *ctx, int64_t num_sequences,
                                                          const int64_t *seq_offsets,
                                                          const int64_t *tokens, unsigned flags,
                                                          forkattn_trie **trie);

/**
 * Build from a tree the caller already has, given per node: its parent and its
 * number of tokens. Nodes may be listed in any order; they are repacked in
 * depth-first order (the child with the most nodes in its subtree first, the
 * others, and ties, in increasing input index) and kept as given
 * (a node with one child is not merged into it). forkattn_trie_input_nodes()
 * maps input nodes to packed ones. Cycles, parents out of range, nodes of
 * length < 1 and token counts that overflow int64 are errors.
 *
 * @param ctx the context
 * @param num_nodes n >= 1
 * @param parents n entries: -1 for a root, else an index in [0, n) other than i
 * @param node_lengths n entries >= 1
 * @param flags 0 or ::FORKATTN_TRIE_SINGLE_ROOT
 * @param trie receives the trie
 * @return as forkattn_trie_from_sequences()
 */
FORKATTN_API forkattn_status forkattn_trie_from_parents(forkattn_ctx *ctx, int64_t num_nodes,
                                                        const int64_t *parents,
                                                        const int64_t *node_lengths, unsigned flags,
                                                        forkattn_trie **trie);

/**
 * Build from a per-token parent array: token i follows token token_parents[i]
 * (-1 for a first token). Maximal chains of only children become nodes: a
 * token starts a node when it is a first token or has siblings. Children are
 * packed largest subtree first, the others, and ties, in increasing index of
 * their first token, so tokens numbered in order
 * of first appearance give the same trie as forkattn_trie_from_sequences() on
 * the root-to-leaf paths. Cycles and parents out of range are errors.
 *
 * @param ctx the context
 * @param num_tokens n >= 1
 * @param token_parents n entries: -1, or a token index in [0, n) other than i
 * @param flags 0 or ::FORKATTN_TRIE_SINGLE_ROOT
 * @param trie receives the trie
 * @return as forkattn_trie_from_sequences()
 */
FORKATTN_API forkattn_status forkattn_trie_from_token_parents(forkattn_ctx *ctx, int64_t num_tokens,
                                                              const int64_t *token_parents,
                                                              unsigned flags, forkattn_trie **trie);

/** Free a trie (NULL is a no-op). @param trie the trie */
FORKATTN_API void forkattn_trie_free(forkattn_trie *trie);

/** The packed tree, ready for forkattn_tree_fwd() (arrays owned by the trie).
 *  @param trie the trie
 *  @param[out] layout receives its layout (an empty layout when trie is NULL)
 *  @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT (trie or layout NULL) */
FORKATTN_API forkattn_status forkattn_trie_layout(const forkattn_trie *trie, forkattn_tree_layout *layout);

/** Packed rows T. @param trie the trie @return node_offsets[n] */
FORKATTN_API int64_t forkattn_trie_num_rows(const forkattn_trie *trie);

/** Tokens before deduplication: the sum of sequence lengths (from sequences) or of
 *  root-to-leaf path lengths over the leaves (from node or token parents).
 *  @param trie the trie @return the count (0 for NULL) */
FORKATTN_API int64_t forkattn_trie_replicated_tokens(const forkattn_trie *trie);

/** Deduplication ratio: replicated tokens / packed rows (>= 1).
 *  @param trie the trie @return the ratio (0 for NULL) */
FORKATTN_API double forkattn_trie_dedup_ratio(const forkattn_trie *trie);

/**
 * Packed row of every input token: from sequences, entry seq_offsets[s] + j is
 * the row holding position j of sequence s (gather per-sequence log-probs with
 * it); from token parents, entry i is token i's row; from node parents, entry
 * input_offset(i) + j for node i in input order (input_offset = exclusive prefix
 * sum of node_lengths).
 * @param trie the trie @return an array of the input's token count
 */
FORKATTN_API const int64_t *forkattn_trie_input_rows(const forkattn_trie *trie);

/**
 * Packed node index of every input node, for tries built by
 * forkattn_trie_from_parents() (entry i: where input node i went).
 * @param trie the trie @return [num_nodes], or NULL for other tries
 */
FORKATTN_API const int64_t *forkattn_trie_input_nodes(const forkattn_trie *trie);

/** Node (packed index) of every row. @param trie the trie @return [T] */
FORKATTN_API const int64_t *forkattn_trie_row_nodes(const forkattn_trie *trie);

/** Position of every row in its sequences: the number of ancestor tokens (use as
 *  position ids). @param trie the trie @return [T] */
FORKATTN_API const int64_t *forkattn_trie_row_positions(const forkattn_trie *trie);

/** Depth of every node (roots 0). @param trie the trie @return [n] */
FORKATTN_API const int64_t *forkattn_trie_node_depths(const forkattn_trie *trie);

/** Token id of every row (tries built from sequences; NULL otherwise).
 *  @param trie the trie @return [T] or NULL */
FORKATTN_API const int64_t *forkattn_trie_row_tokens(const forkattn_trie *trie);
/**@}*/

/** @name Layouts, kept sets (KV compression) and kept-set attention
 * StreamKL and kept-set attention take either layout of the attention calls
 * above. A single dense sequence of T rows is the prefix layout with
 * prompt_len = T and no responses. */
/**@{*/

/** One of the two packed layouts: exactly one pointer is non-NULL. */
typedef struct forkattn_layout {
  const forkattn_prefix_layout *prefix; /**< shared-prompt group (or one dense sequence) */
  const forkattn_tree_layout *tree;     /**< packed tree */
} forkattn_layout;

/** Side of a block of the block-mask form of a kept set (rows and keys). */
#define FORKATTN_KEPT_BLOCK 64

/**
 * The keys a compressed KV cache keeps, per head: the student side of
 * shadow-mask distillation and the mask of kept-set attention. Two forms,
 * either or both (they combine with AND); all arrays in host memory.
 *
 *  - Index lists (CSR): head h keeps key rows index[offsets[h] .. offsets[h+1])
 *    (strictly increasing, each < compressed_rows) among the key rows
 *    [0, compressed_rows); key rows >= compressed_rows (tokens generated after
 *    compression) are always kept. The lists apply to query rows >= query_start
 *    only: rows before it (a prefill that saw the full cache) are unrestricted.
 *    This is what forkattn_kv_select() produces, with rows relative to the
 *    compressed sequence starting at packed row 0 (a prompt, a tree's root).
 *  - Block mask: block_mask[(h * nb + i) * nb + j] = 0 drops every key of key
 *    block j for every query of query block i (nb = ceil(T / 64), blocks of
 *    ::FORKATTN_KEPT_BLOCK packed rows).
 *
 * Query head hq uses kept head hq / (Hq / heads). A query row whose kept keys
 * are all masked sees no key: o = 0, lse = -inf, zero gradients.
 */
typedef struct forkattn_kept_set {
  int64_t heads;                   /**< >= 1, divides the query heads it is used with */
  int64_t compressed_rows;         /**< index lists cover key rows [0, compressed_rows), 0 <= compressed_rows <= T */
  int64_t query_start;             /**< index lists apply to query rows >= query_start (>= 0; T or more: none) */
  const int64_t *offsets;          /**< [heads+1] CSR offsets from 0, or NULL (no lists) */
  const int64_t *index;            /**< kept key rows, per head ascending; NULL iff offsets is */
  const unsigned char *block_mask; /**< [heads, nb, nb] 0/1, or NULL (no block mask) */
} forkattn_kept_set;

/**
 * Forward attention restricted to a kept set (the compressed rollout's
 * attention): a row sees the keys its layout shows it that the kept set keeps.
 * Tensors, lse and errors as in forkattn_prefix_fwd() with T the layout's rows.
 *
 * @param ctx the context
 * @param layout the packed layout (host memory)
 * @param kept the kept set (host memory), or NULL for the full layout
 * @param q queries [T, Hq, d] @param k keys [T, Hkv, d] @param v values [T, Hkv, d]
 * @param o output [T, Hq, d] @param lse optional float32 [T, Hq]
 * @param scale softmax scale (finite, > 0) @param memory where tensors and lse live
 * @return as forkattn_prefix_fwd()
 */
FORKATTN_API forkattn_status forkattn_kept_fwd(forkattn_ctx *ctx, const forkattn_layout *layout,
                                               const forkattn_kept_set *kept, const forkattn_tensor *q,
                                               const forkattn_tensor *k, const forkattn_tensor *v,
                                               const forkattn_tensor *o, float *lse, float scale,
                                               forkattn_memory memory);

/**
 * Backward of forkattn_kept_fwd(), deterministic, outputs overwritten; dropped
 * keys receive no gradient from the rows that do not see them.
 *
 * @param ctx the context
 * @param layout the packed layout (host memory), as in the forward
 * @param kept the kept set of the forward (host memory), or NULL
 * @param q queries [T, Hq, d] @param k keys [T, Hkv, d] @param v values [T, Hkv, d]
 * @param o the forward's output [T, Hq, d] @param dout gradient of the loss with respect to o
 * @param lse float32 [T, Hq] from the forward (required)
 * @param dq output [T, Hq, d] @param dk output [T, Hkv, d] @param dv output [T, Hkv, d]
 * @param scale the forward's softmax scale @param memory where every tensor and lse live
 * @return as forkattn_prefix_bwd()
 */
FORKATTN_API forkattn_status forkattn_kept_bwd(forkattn_ctx *ctx, const forkattn_layout *layout,
                                               const forkattn_kept_set *kept, const forkattn_tensor *q,
                                               const forkattn_tensor *k, const forkattn_tensor *v,
                                               const forkattn_tensor *o, const forkattn_tensor *dout,
                                               const float *lse, const forkattn_tensor *dq,
                                               const forkattn_tensor *dk, const forkattn_tensor *dv,
                                               float scale, forkattn_memory memory);

/** KV-cache compression policies of forkattn_kv_select(). */
typedef enum forkattn_kv_policy_kind {
  /** StreamingLLM: the first `sinks` keys and the most recent budget - sinks. */
  FORKATTN_KV_STREAMING_LLM = 0,
  /** H2O: the `window` most recent keys plus the budget - window heavy hitters,
   *  ranked by the attention mass every query of the sequence gives them
   *  (causal softmax, summed over the query heads of the KV head). */
  FORKATTN_KV_H2O = 1,
  /** SnapKV: the last `window` queries (observation window) score the keys
   *  before them (causal softmax mass summed over the window's rows and the
   *  KV head's query heads), scores are summed over a sliding window of
   *  `pool_kernel` positions (average pooling up to a constant), the top
   *  budget - window are kept together with the window itself. */
  FORKATTN_KV_SNAPKV = 2
} forkattn_kv_policy_kind;

/** A compression policy and its budget. Initialize with forkattn_kv_policy_init(). */
typedef struct forkattn_kv_policy {
  size_t struct_size;           /**< sizeof(forkattn_kv_policy), set by forkattn_kv_policy_init() */
  forkattn_kv_policy_kind kind; /**< the policy */
  int64_t budget;               /**< kept keys per KV head (>= 1); shorter sequences keep all */
  int64_t sinks;                /**< StreamingLLM attention sinks (0 <= sinks <= budget) */
  int64_t window;               /**< H2O recent keys / SnapKV observation window (0..budget) */
  int64_t pool_kernel;          /**< SnapKV pooling width (odd, >= 1) */
  float scale;                  /**< score softmax scale; 0 = 1/sqrt(head_dim) */
} forkattn_kv_policy;

/** Defaults for a kind and budget: struct_size, sinks 4, H2O window budget/2, SnapKV window
 *  min(32, budget), pool_kernel 5, scale 0 (each clamped to the budget).
 *  @param policy filled in (NULL: nothing happens) @param kind the policy
 *  @param budget kept keys per KV head */
FORKATTN_API void forkattn_kv_policy_init(forkattn_kv_policy *policy, forkattn_kv_policy_kind kind,
                                          int64_t budget);

/**
 * Select the kept keys of one causal sequence of L = q->rows = k->rows rows
 * per KV head, streaming (no L x L buffer; H2O and SnapKV recompute the
 * softmax tile by tile from saved row statistics). Ties go to the earlier key.
 *
 * @param ctx the context (CPU work; device tensors are staged to the host)
 * @param policy the policy (from forkattn_kv_policy_init(); its struct_size is checked)
 * @param q queries [L, Hq, d] (unused by StreamingLLM but validated)
 * @param k keys [L, Hkv, d]
 * @param offsets output [Hkv + 1] CSR offsets (host)
 * @param index output [Hkv * min(budget, L)] kept rows, per head ascending (host)
 * @param memory where q and k live
 * @return FORKATTN_OK or an error as for the attention calls
 */
FORKATTN_API forkattn_status forkattn_kv_select(forkattn_ctx *ctx, const forkattn_kv_policy *policy,
                                                const forkattn_tensor *q, const forkattn_tensor *k,
                                                int64_t *offsets, int64_t *index, forkattn_memory memory);
/**@}*/

/** @name StreamKL: attention distillation in O(rows) extra memory
 * Per query row i and query head h, the KL divergence between the teacher's
 * attention distribution T = softmax(t) and the student's S = softmax(s) over
 * the keys the layout shows row i, with t_j = scale_teacher * q_t.k_tj / tau
 * and s_j = scale_student * q_s.k_sj / tau; one tiled pass over the keys, no
 * rows x keys buffer in forward or backward. Teacher and student share the
 * query head count H and the rows; their KV heads (GQA) and head_dims may
 * differ. With a kept set the student sees only the kept keys (shadow mask):
 * forward KL(T||S) uses the teacher renormalised on the kept keys and
 * reports the teacher mass outside them; reverse KL(S||T) uses the full
 * teacher (it is finite since S lives inside T's support). docs/distillation.md. */
/**@{*/

/** Direction of the divergence. */
typedef enum forkattn_kl_direction {
  FORKATTN_KL_FORWARD = 0, /**< KL(T||S) = sum_j T_j log(T_j / S_j) */
  FORKATTN_KL_REVERSE = 1  /**< KL(S||T) = sum_j S_j log(S_j / T_j) */
} forkattn_kl_direction;

/** Number of floats per (row, head) in the saved statistics. */
#define FORKATTN_KL_STATS 4

/** StreamKL options. Initialize with forkattn_kl_options_init(). */
typedef struct forkattn_kl_options {
  size_t struct_size;              /**< sizeof(forkattn_kl_options), set by forkattn_kl_options_init() */
  forkattn_kl_direction direction; /**< which divergence */
  float scale_teacher;             /**< teacher score scale; 0 = 1/sqrt(teacher head_dim) */
  float scale_student;             /**< student score scale; 0 = 1/sqrt(student head_dim) */
  float temperature;               /**< tau > 0, finite: scores divided by tau */
  int scale_by_tau2;               /**< non-zero: the loss is multiplied by tau^2 (tau^2 must be finite) */
} forkattn_kl_options;

/** struct_size, forward KL, default scales, tau = 1.
 *  @param opt filled in (NULL: nothing happens) */
FORKATTN_API void forkattn_kl_options_init(forkattn_kl_options *opt);

/**
 * StreamKL forward.
 *
 * @param ctx the context
 * @param layout the packed layout (host memory); T its rows
 * @param q_t teacher queries [T, H, d_t] @param k_t teacher keys [T, Hkv_t, d_t]
 * @param q_s student queries [T, H, d_s] @param k_s student keys [T, Hkv_s, d_s]
 *        (teacher and student dtypes may differ)
 * @param kept the student's kept set (host memory), or NULL for a dense student
 * @param opt options (NULL: forkattn_kl_options_init())
 * @param kl output float32 [T, H]: the divergence of each row (times tau^2 on
 *        request); 0 for a row that sees no key or keeps none
 * @param stats optional output float32 [T, H, ::FORKATTN_KL_STATS] for the
 *        backward (NULL to skip)
 * @param outside_mass optional output float32 [T, H]: teacher probability on
 *        keys the kept set drops (0 without a kept set, 1 for a row keeping none)
 * @param memory where tensors and outputs live
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT (outputs untouched);
 *         FORKATTN_ERR_OUT_OF_MEMORY; FORKATTN_ERR_DEVICE
 */
FORKATTN_API forkattn_status forkattn_kl_fwd(forkattn_ctx *ctx, const forkattn_layout *layout,
                                             const forkattn_tensor *q_t, const forkattn_tensor *k_t,
                                             const forkattn_tensor *q_s, const forkattn_tensor *k_s,
                                             const forkattn_kept_set *kept,
                                             const forkattn_kl_options *opt, float *kl, float *stats,
                                             float *outside_mass, forkattn_memory memory);

/**
 * StreamKL backward: gradients of sum_{i,h} dkl[i,h] * kl[i,h] with respect to
 * the student's q and k, and optionally the teacher's, recomputing both
 * distributions tile by tile from the saved statistics. Deterministic;
 * outputs overwritten (dtype of the matching input).
 *
 * @param ctx the context
 * @param layout the packed layout (host memory), as in the forward
 * @param q_t teacher queries @param k_t teacher keys @param q_s student queries
 * @param k_s student keys (as in the forward)
 * @param kept the forward's kept set, or NULL @param opt the forward's options (NULL: defaults)
 * @param stats float32 [T, H, ::FORKATTN_KL_STATS] from the forward (required)
 * @param dkl float32 [T, H] upstream gradient of kl
 * @param dq_s [T, H, d_s] @param dk_s [T, Hkv_s, d_s] student gradients (required)
 * @param dq_t [T, H, d_t] @param dk_t [T, Hkv_t, d_t] teacher gradients: both
 *        NULL to skip, or both given
 * @param memory where tensors and arrays live
 * @return as forkattn_kl_fwd()
 */
FORKATTN_API forkattn_status forkattn_kl_bwd(forkattn_ctx *ctx, const forkattn_layout *layout,
                                             const forkattn_tensor *q_t, const forkattn_tensor *k_t,
                                             const forkattn_tensor *q_s, const forkattn_tensor *k_s,
                                             const forkattn_kept_set *kept,
                                             const forkattn_kl_options *opt, const float *stats,
                                             const float *dkl, const forkattn_tensor *dq_s,
                                             const forkattn_tensor *dk_s, const forkattn_tensor *dq_t,
                                             const forkattn_tensor *dk_t, forkattn_memory memory);

/**
 * Weighted mean of a [rows, heads] float32 array over rows (e.g. kl with a
 * loss mask of response tokens): sum_{i,h} w_i x[i,h] / (heads * sum_i w_i),
 * accumulated in double. weights NULL means all 1; weights must be finite and
 * >= 0; a zero total weight gives 0. The gradient of the mean with respect to
 * x[i,h] is w_i / (heads * sum w): pass that as dkl.
 *
 * @param ctx the context @param x [rows, heads] @param rows >= 0 @param heads >= 1
 * @param weights [rows] or NULL @param mean output (host)
 * @param memory where x and weights live
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT; FORKATTN_ERR_OUT_OF_MEMORY (device
 *         arrays are copied to the host); FORKATTN_ERR_DEVICE
 */
FORKATTN_API forkattn_status forkattn_rows_mean(forkattn_ctx *ctx, const float *x, int64_t rows,
                                                int64_t heads, const float *weights, double *mean,
                                                forkattn_memory memory);
/**@}*/

/** @name Shared-prefix KV cache for diffusion LMs (BiCache)
 * Diffusion LMs attend bidirectionally, so a prefix's K/V depends on what
 * follows it: reusing it is only safe in the shallow layers where it barely
 * changes. The cache stores a prefix's per-layer K/V computed alone; a
 * reuse-depth profile says, from the share r = prefix / sequence of a request,
 * how many leading layers b(r) may reuse it; the request's tokens then attend
 * to [cached prefix K/V ; own K/V] (forkattn_prefix_cached_fwd()) in those
 * layers and everything is recomputed in the deeper ones. docs/dlm-cache.md. */
/**@{*/

/**
 * Attention of new rows against a shared prefix whose K/V already exist (a
 * cache): only the responses' rows have queries. Keys and values hold the
 * prefix rows first, then the responses: [P + R_total, Hkv, d]; queries,
 * outputs and lse hold the responses only: [R_total, Hq, d]. Response i's
 * query rows [off[i], off[i+1]) see all P prefix keys and their own keys
 * (causally with FORKATTN_MASK_CAUSAL, all of them with
 * FORKATTN_MASK_BIDIRECTIONAL); it is forkattn_prefix_fwd() on the same
 * layout minus the prompt's own query rows.
 *
 * @param ctx the context @param layout the group (P = prompt_len cached rows)
 * @param q queries [R_total, Hq, d] @param k keys [P + R_total, Hkv, d]
 * @param v values [P + R_total, Hkv, d] @param o output [R_total, Hq, d]
 * @param lse optional float32 [R_total, Hq] @param scale softmax scale (finite, > 0)
 * @param memory where tensors and lse live
 * @return as forkattn_prefix_fwd()
 */
FORKATTN_API forkattn_status forkattn_prefix_cached_fwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout,
                                                        const forkattn_tensor *q, const forkattn_tensor *k,
                                                        const forkattn_tensor *v, const forkattn_tensor *o,
                                                        float *lse, float scale, forkattn_memory memory);

/**
 * Backward of forkattn_prefix_cached_fwd(): dq of the responses' rows and
 * dk/dv of every key row (the prefix rows' summed over all responses).
 * Deterministic; outputs overwritten.
 *
 * @param ctx the context @param layout the group, as in the forward
 * @param q queries [R_total, Hq, d] @param k keys [P + R_total, Hkv, d]
 * @param v values [P + R_total, Hkv, d] @param o the forward's output
 * @param dout gradient with respect to o @param lse float32 [R_total, Hq] (required)
 * @param dq output [R_total, Hq, d] @param dk output [P + R_total, Hkv, d]
 * @param dv output [P + R_total, Hkv, d] @param scale the forward's scale
 * @param memory where every tensor and lse live
 * @return as forkattn_prefix_bwd()
 */
FORKATTN_API forkattn_status forkattn_prefix_cached_bwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout,
                                                        const forkattn_tensor *q, const forkattn_tensor *k,
                                                        const forkattn_tensor *v, const forkattn_tensor *o,
                                                        const forkattn_tensor *dout, const float *lse,
                                                        const forkattn_tensor *dq, const forkattn_tensor *dk,
                                                        const forkattn_tensor *dv, float scale,
                                                        forkattn_memory memory);

/**
 * Block-causal variant of forkattn_prefix_cached_fwd() (block diffusion LMs,
 * semi-autoregressive decoding): response i's rows form blocks of block_size
 * rows from its first row (the last may be shorter); a row of block j sees all
 * P prefix keys and every key of the response's blocks 0..j (bidirectional
 * inside a block, causal across blocks). The layout's mask is not used.
 * block_size 1 runs exactly as forkattn_prefix_cached_fwd() with the causal
 * mask, and a block_size at least as long as every response (up to INT64_MAX)
 * exactly as with the bidirectional mask (same results, bit for bit, and the
 * same cost). Between the two, the plan takes two (query, key) pairs per
 * block, so its memory is linear in the rows; the backward works on key
 * blocks of at most block_size rows, so very small blocks (2, 3, ...) run its
 * dk/dv in small tiles, slower than the causal call.
 *
 * @param ctx the context @param layout the group (P = prompt_len cached rows)
 * @param block_size rows per block (>= 1, any value; 1 is the causal mask)
 * @param q queries [R_total, Hq, d] @param k keys [P + R_total, Hkv, d]
 * @param v values [P + R_total, Hkv, d] @param o output [R_total, Hq, d]
 * @param lse optional float32 [R_total, Hq] @param scale softmax scale (finite, > 0)
 * @param memory where tensors and lse live
 * @return as forkattn_prefix_fwd()
 */
FORKATTN_API forkattn_status forkattn_prefix_cached_block_fwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout,
                                                              int64_t block_size, const forkattn_tensor *q,
                                                              const forkattn_tensor *k, const forkattn_tensor *v,
                                                              const forkattn_tensor *o, float *lse, float scale,
                                                              forkattn_memory memory);

/**
 * Backward of forkattn_prefix_cached_block_fwd(), as forkattn_prefix_cached_bwd().
 *
 * @param ctx the context @param layout the group, as in the forward
 * @param block_size the forward's block size
 * @param q queries [R_total, Hq, d] @param k keys [P + R_total, Hkv, d]
 * @param v values [P + R_total, Hkv, d] @param o the forward's output
 * @param dout gradient with respect to o @param lse float32 [R_total, Hq] (required)
 * @param dq output [R_total, Hq, d] @param dk output [P + R_total, Hkv, d]
 * @param dv output [P + R_total, Hkv, d] @param scale the forward's scale
 * @param memory where every tensor and lse live
 * @return as forkattn_prefix_bwd()
 */
FORKATTN_API forkattn_status forkattn_prefix_cached_block_bwd(forkattn_ctx *ctx, const forkattn_prefix_layout *layout,
                                                              int64_t block_size, const forkattn_tensor *q,
                                                              const forkattn_tensor *k, const forkattn_tensor *v,
                                                              const forkattn_tensor *o, const forkattn_tensor *dout,
                                                              const float *lse, const forkattn_tensor *dq,
                                                              const forkattn_tensor *dk, const forkattn_tensor *dv,
                                                              float scale, forkattn_memory memory);

/** A cache of prefixes' per-layer K/V, keyed by token prefix. Thread-safe:
 *  any number of threads may insert, look up and release at once. */
typedef struct forkattn_kv_cache forkattn_kv_cache;
/** A cached prefix held by a reader: never evicted while held. */
typedef struct forkattn_kv_entry forkattn_kv_entry;

/** Shape and budget of a cache. Initialize with forkattn_kv_cache_options_init(). */
typedef struct forkattn_kv_cache_options {
  size_t struct_size;     /**< sizeof(forkattn_kv_cache_options), set by forkattn_kv_cache_options_init() */
  size_t capacity_bytes;  /**< > 0: the entries' K/V bytes never exceed it */
  int64_t block_tokens;   /**< tokens per hashed block of the radix index (0: 16) */
  int64_t layers;         /**< layers per entry (>= 1) */
  int64_t kv_heads;       /**< KV heads (>= 1) */
  int64_t head_dim;       /**< 1..256 */
  forkattn_dtype dtype;   /**< storage type of K/V */
  forkattn_memory memory; /**< where entries live: host, or device (GPU backend) */
} forkattn_kv_cache_options;

/** Fill @p opt with defaults: struct_size, block_tokens 0 (16), float32, host
 *  memory; capacity_bytes, layers, kv_heads and head_dim 0 (set them).
 *  @param opt options to initialize (NULL is ignored) */
FORKATTN_API void forkattn_kv_cache_options_init(forkattn_kv_cache_options *opt);

/** Counters of a cache (forkattn_kv_cache_get_stats()). */
typedef struct forkattn_kv_cache_stats {
  uint64_t hits;        /**< lookups that found a cached prefix */
  uint64_t misses;      /**< lookups that found none */
  uint64_t insertions;  /**< entries stored */
  uint64_t evictions;   /**< entries evicted (LRU) */
  uint64_t rejected;    /**< insertions refused: larger than the capacity, or only held entries to evict */
  size_t bytes;         /**< K/V bytes held now (<= capacity_bytes) */
  int64_t entries;      /**< entries held now */
} forkattn_kv_cache_stats;

/**
 * Create a cache. The context supplies the backend for device entries; the
 * cache must be destroyed before the context.
 * @param ctx the context @param opt shape and budget (from
 *        forkattn_kv_cache_options_init()) @param cache the new cache
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT (capacity 0, bad shape,
 *         device memory without the GPU backend, unknown struct_size);
 *         FORKATTN_ERR_OUT_OF_MEMORY
 */
FORKATTN_API forkattn_status forkattn_kv_cache_create(forkattn_ctx *ctx, const forkattn_kv_cache_options *opt,
                                                      forkattn_kv_cache **cache);
/** Destroy a cache (no entry may still be held). @param cache the cache (NULL: nothing) */
FORKATTN_API void forkattn_kv_cache_destroy(forkattn_kv_cache *cache);

/**
 * Store the K/V of the prefix tokens[0..n) computed alone: k[l], v[l] for
 * each of the cache's layers, [n, kv_heads, head_dim] in the cache's dtype, in
 * `memory`. An equal prefix already cached is refreshed (its K/V replaced
 * unless held, then kept) and becomes most recently used. Least recently used
 * unheld entries are evicted to make room; an entry that cannot fit is
 * rejected (counted, FORKATTN_OK returned, *stored = 0).
 * @param cache the cache @param tokens n token ids (host) @param n >= 1
 * @param k array of `layers` key tensors @param v array of `layers` value tensors
 * @param memory where k and v live @param stored optional: 1 if stored, else 0
 * @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT; FORKATTN_ERR_OUT_OF_MEMORY; FORKATTN_ERR_DEVICE
 */
FORKATTN_API forkattn_status forkattn_kv_cache_insert(forkattn_kv_cache *cache, const int32_t *tokens, int64_t n,
                                                      const forkattn_tensor *k, const forkattn_tensor *v,
                                                      forkattn_memory memory, int *stored);

/**
 * Find the longest cached prefix of tokens[0..n) (an entry whose tokens equal
 * tokens[0..m) for the largest m) and hold it: it is not evicted until
 * forkattn_kv_cache_release(). A miss gives *entry = NULL and *matched = 0.
 * @param cache the cache @param tokens the request's tokens (host) @param n >= 0
 * @param entry the held entry or NULL @param matched its length m
 * @return FORKATTN_OK or FORKATTN_ERR_INVALID_ARGUMENT
 */
FORKATTN_API forkattn_status forkattn_kv_cache_lookup(forkattn_kv_cache *cache, const int32_t *tokens, int64_t n,
                                                      forkattn_kv_entry **entry, int64_t *matched);

/** K of layer `layer` of a held entry: [m, kv_heads, head_dim] in the cache's
 *  memory (read-only for the holder).
 *  @param entry a held entry @param layer 0..layers-1
 *  @param[out] view receives the view (a tensor with data NULL on error)
 *  @return FORKATTN_OK; FORKATTN_ERR_INVALID_ARGUMENT (entry or view NULL, or
 *          a bad layer) */
FORKATTN_API forkattn_status forkattn_kv_entry_k(const forkattn_kv_entry *entry, int64_t layer,
                                                 forkattn_tensor *view);
/** V of layer `layer` of a held entry, as forkattn_kv_entry_k().
 *  @param entry a held entry @param layer 0..layers-1
 *  @param[out] view receives the view (a tensor with data NULL on error)
 *  @return as forkattn_kv_entry_k() */
FORKATTN_API forkattn_status forkattn_kv_entry_v(const forkattn_kv_entry *entry, int64_t layer,
                                                 forkattn_tensor *view);
/** Release a held entry. @param cache the cache @param entry from forkattn_kv_cache_lookup() (NULL: nothing) */
FORKATTN_API void forkattn_kv_cache_release(forkattn_kv_cache *cache, forkattn_kv_entry *entry);
/** Counters. @param cache the cache @param stats filled in @return FORKATTN_OK or INVALID_ARGUMENT */
FORKATTN_API forkattn_status forkattn_kv_cache_get_stats(forkattn_kv_cache *cache, forkattn_kv_cache_stats *stats);

/**
 * Per-head similarity of two K (or V) tensors over the same rows, fused and
 * streaming: sim[h] = mean over rows r of cos(a[r,h,:], b[r,h,:]) (a row where
 * either vector is all zero counts as 1 if both are, else 0). Used to measure
 * how far a prefix's K/V computed alone drifts from the same rows computed
 * inside the full input.
 * @param ctx the context @param a [rows, heads, d] @param b same shape (dtype may differ)
 * @param sim output float32 [heads] (host) @param mean optional: mean over heads (host)
 * @param memory where a and b live
 * @return FORKATTN_OK or an error as for the attention calls
 */
FORKATTN_API forkattn_status forkattn_kv_similarity(forkattn_ctx *ctx, const forkattn_tensor *a,
                                                    const forkattn_tensor *b, float *sim, float *mean,
                                                    forkattn_memory memory);
/**@}*/

#ifdef __cplusplus
}
#endif
#endif /* FORKATTN_H */
