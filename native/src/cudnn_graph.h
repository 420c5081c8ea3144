// attnlib's graph-agnostic cuDNN executor: declarations shared by the FFI handlers and the nanobind module.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

// The FFI handlers of target `attnlib_cudnn_graph` (one per stage) and the state type they share.
extern "C" XLA_FFI_Error* AttnlibCudnnGraphInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AttnlibCudnnGraphInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AttnlibCudnnGraphExecute(XLA_FFI_CallFrame* call_frame);
// The same execute handler without the command-buffer trait (XLA then never captures it into a CUDA graph).
extern "C" XLA_FFI_Error* AttnlibCudnnGraphExecuteNoCmdBuffer(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_TypeId* AttnlibGraphStateTypeId();
extern "C" const XLA_FFI_TypeInfo* AttnlibGraphStateTypeInfo();

namespace attnlib {

// Error convention: every helper below that can fail returns `xla::ffi::ErrorOr<T>`, like the FFI handlers. The error
// is `Error::InvalidArgument` when the caller's input is bad (an unreadable blob, inconsistent tensor descriptions)
// and `Error::Internal` when libcudnn, CUDA or cuDNN fails; its message is complete (the Python module only picks
// the exception type: ValueError for InvalidArgument, RuntimeError otherwise).

// CUDNN_FRONTEND_VERSION of the headers this module was compiled against (e.g. 13200 for 1.32.0). Cannot fail.
int FrontendVersion();

// The versions of the headers this module was compiled against. Cannot fail.
struct BuildInfo {
  int frontend;         // CUDNN_FRONTEND_VERSION, e.g. 13200 for 1.32.0
  int cudnn;            // CUDNN_VERSION of cudnn.h, e.g. 91900 for 9.19.0
  int cuda;             // CUDA_VERSION of cuda.h, e.g. 13000 for 13.0
  int xla_ffi_major;    // XLA_FFI_API_MAJOR
  int xla_ffi_minor;    // XLA_FFI_API_MINOR
  std::string jaxlib;   // the jaxlib whose XLA FFI headers were used ("" when unknown)
};
BuildInfo GetBuildInfo();

// The graph JSON version these headers read ("2.0"). Cannot fail.
std::string GraphJsonVersion();

// Rewrites a serialized graph (UBJSON) so that equal graphs give equal bytes: the process-global graph id `gid` is
// set to 0. Returns the rewritten blob. Fails with InvalidArgument ("not a serialized cuDNN graph: ...") when the
// blob is not a readable graph.
xla::ffi::ErrorOr<std::string> CanonicalizeGraph(const std::string& blob);

// The version fields a serialized graph records (each empty, or -1, when the graph lacks it).
struct GraphVersionInfo {
  std::string json_version;
  int64_t frontend_version = -1;  // cudnn_frontend_version
  std::string backend_version;    // cudnn_backend_version
};

// Reads the version fields of a serialized graph. Fails with InvalidArgument ("not a serialized cuDNN graph: ...")
// when the blob is not readable UBJSON.
xla::ffi::ErrorOr<GraphVersionInfo> GraphVersions(const std::string& blob);

// Binds the cuDNN frontend to libcudnn: the copy already loaded in the process when there is one, else `hint` (a
// path), else the soname. Returns the cuDNN backend version (e.g. 91900). Fails with Internal ("cannot load
// libcudnn.so.9 (...)...") when no libcudnn can be loaded, or with Internal when its version cannot be read.
xla::ffi::ErrorOr<int64_t> LoadCudnn(const std::string& hint);

// One tensor of a graph timed by `TimeGraph`: its UID, its size in bytes, and its initial contents (empty = zeros).
struct TimedTensor {
  int64_t uid;
  int64_t bytes;
  std::string contents;
};

// Runs a serialized graph on freshly allocated device buffers, on the current device and a private stream, and
// returns the best time of one execution in milliseconds (best of `repeats` timed batches of `batch` executions,
// after one warm-up). Every message starts "timing the cuDNN graph failed: ". Fails with InvalidArgument on bad input
// (repeats or batch below 1, an unreadable blob, contents larger than their tensor, a graph tensor not described in
// `tensors`) and with Internal on any libcudnn, CUDA or cuDNN failure (e.g. out of memory); every allocation is
// released either way.
xla::ffi::ErrorOr<double> TimeGraph(const std::string& blob, const std::vector<TimedTensor>& tensors,
                                    int64_t ws_bytes, int repeats, int batch);

}  // namespace attnlib
