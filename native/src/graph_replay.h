// Records a cuDNN plan's work into CUDA graphs: replayed per set of buffer addresses, or added to XLA's command buffer.
//
// Running a plan costs the host 15-30 us (variant pack, cuDNN's host logic, an auxiliary memset and the kernel launch);
// replaying the same launches from an instantiated CUDA graph costs one cudaGraphLaunch. A graph bakes in the buffer
// addresses, so one is made per address set, on that set's second use (an address set seen once never is), and only
// a bounded number per executable and device is ever made: a caller whose addresses change on every call pays one
// key comparison per call. Calls that find the cache busy on another thread run the plan directly.
//
// A call's graph is built by cuDNN's own CUDA-graph API (a `Record`), as XLA builds its cuDNN commands, and only where
// that fails by capturing the plan's launches on a stream: a stream-captured cuDNN launch made each cudaGraphLaunch of
// the graph holding it wait for the previous one (measured, docs/performance.md). A call made while XLA captures the
// stream into its own command buffer adds its recorded graph to that capture as one node (`RecordIntoCapture`).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace attnlib {

// Process-wide counts, for tests and benchmarks (`_attnlib_ffi.graph_replay_counts`).
struct GraphReplayCounts {
  int64_t captures;  // address sets captured into a CUDA graph
  int64_t replays;   // calls launched from a captured graph
  int64_t direct;    // calls that ran the plan directly
  int64_t failures;  // captures that failed (the cache then stays off for that executable and device)
  int64_t xla_records;  // calls made while XLA captured the stream into its command buffer
  int64_t populated;    // graphs (replay captures and XLA recordings) built by cuDNN's CUDA-graph API
};
GraphReplayCounts ReadGraphReplayCounts();
// Counts a call that ran the plan directly without consulting a cache (replay off for its executable).
void CountDirectRun();

// Whether a call may be replayed: its `replay` attribute (set by the caller for short graphs), unless
// ATTNLIB_CUDNN_GRAPH_REPLAY (read once per executable) says "0" (never) or "always" (every call).
bool GraphReplayAllowed(bool requested);

// The CUDA runtime entry points the cache uses (the extension links no libcudart: the caller resolves them from the
// runtime the process loaded).
struct CudaGraphApi {
  cudaError_t (*stream_create_with_flags)(cudaStream_t*, unsigned int);
  cudaError_t (*stream_destroy)(cudaStream_t);
  cudaError_t (*stream_is_capturing)(cudaStream_t, cudaStreamCaptureStatus*);
  cudaError_t (*stream_begin_capture)(cudaStream_t, cudaStreamCaptureMode);
  cudaError_t (*stream_end_capture)(cudaStream_t, cudaGraph_t*);
  cudaError_t (*graph_instantiate_with_flags)(cudaGraphExec_t*, cudaGraph_t, unsigned long long);
  cudaError_t (*graph_destroy)(cudaGraph_t);
  cudaError_t (*graph_launch)(cudaGraphExec_t, cudaStream_t);
  cudaError_t (*graph_exec_destroy)(cudaGraphExec_t);
  cudaError_t (*get_last_error)();
  cudaError_t (*graph_create)(cudaGraph_t*, unsigned int);
  cudaError_t (*graph_add_child_graph_node)(cudaGraphNode_t*, cudaGraph_t, const cudaGraphNode_t*, size_t, cudaGraph_t);
  cudaError_t (*graph_add_memset_node)(cudaGraphNode_t*, cudaGraph_t, const cudaGraphNode_t*, size_t,
                                       const cudaMemsetParams*);
  cudaError_t (*thread_exchange_stream_capture_mode)(cudaStreamCaptureMode*);
  // CUDA 13's prototypes (edge data); null with an older runtime, whose calls under XLA's capture are stream-captured.
  cudaError_t (*stream_get_capture_info)(cudaStream_t, cudaStreamCaptureStatus*, unsigned long long*, cudaGraph_t*,
                                         const cudaGraphNode_t**, const cudaGraphEdgeData**, size_t*);
  cudaError_t (*stream_update_capture_dependencies)(cudaStream_t, cudaGraphNode_t*, const cudaGraphEdgeData*, size_t,
                                                    unsigned int);
};

// A non-owning reference to the caller's callable `xla::ffi::Error(Arg)`, built at the call site from a lambda.
template <typename Arg>
class Callback {
 public:
  template <typename F>
  Callback(const F& f)  // NOLINT(google-explicit-constructor)
      : context_(&f), call_([](const void* c, Arg a) { return (*static_cast<const F*>(c))(a); }) {}
  xla::ffi::Error operator()(Arg arg) const { return call_(context_, arg); }

 private:
  const void* context_;
  xla::ffi::Error (*call_)(const void*, Arg);
};
// Enqueues the plan's work on the given stream (and nothing else).
using Launch = Callback<cudaStream_t>;
// Builds the plan's work into the given empty CUDA graph without launching anything.
using Record = Callback<cudaGraph_t>;

// Whether XLA is capturing `stream` into a command buffer (false when that cannot be queried).
bool StreamCapturing(const CudaGraphApi& api, cudaStream_t stream);

// Runs a call on a stream XLA is capturing: adds the graph `record` builds to the capture as one child node, or,
// where the runtime or the plan does not allow that, lets the capture take `launch`'s work.
xla::ffi::Error RecordIntoCapture(const CudaGraphApi& api, cudaStream_t stream, const Record& record,
                                  const Launch& launch);

class GraphReplay {
 public:
  static constexpr size_t kMaxAddresses = 48;
  // An address set: the graph's tensor pointers, the workspace and the zero-filled results, in a fixed order.
  struct Key {
    std::array<void*, kMaxAddresses> addresses{};
    size_t size = 0;
    bool operator==(const Key& other) const;
  };
  explicit GraphReplay(const CudaGraphApi& api) : api_(api) {}
  GraphReplay(const GraphReplay&) = delete;
  GraphReplay& operator=(const GraphReplay&) = delete;
  ~GraphReplay();

  // Runs the call on `stream` (not under capture): from the graph made for `key` when there is one, else directly
  // (making that graph first, with `record` or else by capturing `launch` on a private stream, when `key` was seen
  // before and captures are left).
  xla::ffi::Error Run(cudaStream_t stream, const Key& key, const Launch& launch, const Record& record);

 private:
  static constexpr size_t kMaxGraphs = 4;    // instantiated graphs kept (least recently used one replaced)
  static constexpr size_t kRecentKeys = 8;   // address sets remembered without a graph
  static constexpr int kMaxCaptures = 16;    // captures ever made

  struct Captured {
    Key key;
    cudaGraphExec_t exec = nullptr;
    uint64_t last_use = 0;
  };

  xla::ffi::Error Capture(const Launch& launch, const Record& record, cudaGraphExec_t* exec);
  xla::ffi::Error CaptureStream(const Launch& launch, cudaGraph_t* graph);
  bool SeenRecently(const Key& key);

  const CudaGraphApi& api_;
  std::mutex mu_;
  std::vector<Captured> graphs_;
  std::array<Key, kRecentKeys> recent_{};
  size_t recent_next_ = 0;
  uint64_t clock_ = 0;
  int captures_left_ = kMaxCaptures;
  bool off_ = false;
  cudaStream_t capture_stream_ = nullptr;
};

}  // namespace attnlib
