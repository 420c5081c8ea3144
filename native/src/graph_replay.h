// Replays a cuDNN plan's launches from CUDA graphs captured once per set of buffer addresses.
//
// Running a plan costs the host 15-30 us (variant pack, cuDNN's host logic, an auxiliary memset and the kernel launch);
// replaying the same launches from an instantiated CUDA graph costs one cudaGraphLaunch. A graph bakes in the buffer
// addresses, so one is captured per address set, on that set's second use (an address set seen once is never
// captured), and only a bounded number of captures per executable and device is ever made: a caller whose addresses
// change on every call pays one key comparison per call. Calls that find the cache busy on another thread run the
// plan directly.
//
// Both here and when XLA captures the call into its own command buffer, cuDNN's launches are first captured on a
// private stream and then issued again by attnlib (relaunch.h): a graph of cuDNN's captured launches is slower to
// launch and holds the host once a few dozen launches of it are queued.
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
  int64_t reissued;     // captures of cuDNN's launches that attnlib issued again itself (replay graphs, XLA's captures)
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
};

// Whether XLA is capturing `stream` into its command buffer (the call's work then goes into that capture); each such
// call is counted.
bool CapturedByXla(const CudaGraphApi& api, cudaStream_t stream);

class GraphReplay {
 public:
  static constexpr size_t kMaxAddresses = 48;
  // An address set: the graph's tensor pointers, the workspace and the zero-filled results, in a fixed order.
  struct Key {
    std::array<void*, kMaxAddresses> addresses{};
    size_t size = 0;
    bool operator==(const Key& other) const;
  };
  // Enqueues the plan's work on the given stream (and nothing else): a non-owning reference to a callable.
  class Launch {
   public:
    template <typename F>
    Launch(const F& f)  // NOLINT(google-explicit-constructor): built from the caller's lambda at the call site
        : context_(&f), call_([](const void* c, cudaStream_t s) { return (*static_cast<const F*>(c))(s); }) {}
    xla::ffi::Error operator()(cudaStream_t stream) const { return call_(context_, stream); }

   private:
    const void* context_;
    xla::ffi::Error (*call_)(const void*, cudaStream_t);
  };

  // `replay`: whether calls may be replayed (else `Run` always runs the plan directly).
  GraphReplay(const CudaGraphApi& api, bool replay) : api_(api), replay_(replay) {}
  GraphReplay(const GraphReplay&) = delete;
  GraphReplay& operator=(const GraphReplay&) = delete;
  ~GraphReplay();

  // Runs `launch`'s work on `stream` (not under XLA's capture): from the graph captured for `key` when there is one,
  // else directly (capturing it first, on a private stream, when `key` was seen before and captures are left).
  xla::ffi::Error Run(cudaStream_t stream, const Key& key, const Launch& launch);

  // Puts `launch`'s work into XLA's capture of `stream`: captured on the private stream and issued again on `stream`
  // (directly on `stream` when that cannot be done).
  xla::ffi::Error RunIntoCapture(cudaStream_t stream, const Launch& launch);

 private:
  static constexpr size_t kMaxGraphs = 4;    // instantiated graphs kept (least recently used one replaced)
  static constexpr size_t kRecentKeys = 8;   // address sets remembered without a graph
  static constexpr int kMaxCaptures = 16;    // captures ever made

  struct Captured {
    Key key;
    cudaGraphExec_t exec = nullptr;
    uint64_t last_use = 0;
  };

  // Captures `launch`'s work on the private stream (mu_ held).
  xla::ffi::Error CaptureGraph(const Launch& launch, cudaGraph_t* graph);
  xla::ffi::Error Capture(const Launch& launch, cudaGraphExec_t* exec);
  bool SeenRecently(const Key& key);

  const CudaGraphApi& api_;
  const bool replay_;
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
