// attnlib's graph-agnostic cuDNN executor: declarations shared by the FFI handlers and the nanobind module.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

// The FFI handlers of target `attnlib_cudnn_graph` (one per stage) and the state type they share.
extern "C" XLA_FFI_Error* AttnlibCudnnGraphInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AttnlibCudnnGraphInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AttnlibCudnnGraphExecute(XLA_FFI_CallFrame* call_frame);
// The same execute handler without the command-buffer trait (XLA then never captures it into a CUDA graph).
extern "C" XLA_FFI_Error* AttnlibCudnnGraphExecuteNoCmdBuffer(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_TypeId* AttnlibGraphStateTypeId();
extern "C" const XLA_FFI_TypeInfo* AttnlibGraphStateTypeInfo();

namespace attnlib {

// CUDNN_FRONTEND_VERSION of the headers this module was compiled against (e.g. 13200 for 1.32.0).
int FrontendVersion();

// The graph JSON version these headers read ("2.0").
std::string GraphJsonVersion();

// Rewrites a serialized graph (UBJSON) so that equal graphs give equal bytes: the process-global graph id `gid` is
// set to 0. Returns false and sets `error` when the blob is not a readable graph.
bool CanonicalizeGraph(const std::string& blob, std::string* out, std::string* error);

// Reads the version fields of a serialized graph: json_version, cudnn_frontend_version, cudnn_backend_version.
bool GraphVersions(const std::string& blob, std::string* json_version, int64_t* frontend_version,
                   std::string* backend_version, std::string* error);

// Binds the cuDNN frontend to libcudnn: the copy already loaded in the process when there is one, else `hint` (a
// path), else the soname. Returns the cuDNN backend version (e.g. 91900), or -1 with `error` set.
int64_t LoadCudnn(const std::string& hint, std::string* error);

// One tensor of a graph timed by `TimeGraph`: its UID, its size in bytes, and its initial contents (empty = zeros).
struct TimedTensor {
  int64_t uid;
  int64_t bytes;
  std::string contents;
};

// Runs a serialized graph on freshly allocated device buffers, on the current device and a private stream, and
// returns the best time of one execution in milliseconds (best of `repeats` timed batches of `batch` executions,
// after one warm-up). Returns a negative value and sets `error` on any CUDA or cuDNN failure (e.g. out of memory);
// every allocation is released either way.
double TimeGraph(const std::string& blob, const std::vector<TimedTensor>& tensors, int64_t ws_bytes, int repeats,
                 int batch, std::string* error);

}  // namespace attnlib
