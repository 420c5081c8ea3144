// The CUDA-graph replay cache of graph_replay.h.

#include "graph_replay.h"

#include "relaunch.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace ffi = xla::ffi;

namespace attnlib {
namespace {

std::atomic<int64_t> g_captures{0};
std::atomic<int64_t> g_replays{0};
std::atomic<int64_t> g_direct{0};
std::atomic<int64_t> g_failures{0};
std::atomic<int64_t> g_xla_records{0};
std::atomic<int64_t> g_reissued{0};

ffi::Error CudaFailure(const char* step, cudaError_t err) {
  return ffi::Error::Internal(std::string("attnlib CUDA graph replay, ") + step + ": CUDA error " +
                              std::to_string(static_cast<int>(err)) + ".");
}

ffi::Error DriverFailure(const char* step, CUresult err) {
  return ffi::Error::Internal(std::string("attnlib CUDA graph replay, ") + step + ": CUDA driver error " +
                              std::to_string(static_cast<int>(err)) + ".");
}

}  // namespace

GraphReplayCounts ReadGraphReplayCounts() {
  return {g_captures.load(), g_replays.load(), g_direct.load(), g_failures.load(), g_xla_records.load(),
          g_reissued.load()};
}

bool CapturedByXla(const CudaGraphApi& api, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (api.stream_is_capturing(stream, &status) != cudaSuccess || status == cudaStreamCaptureStatusNone) return false;
  g_xla_records.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void CountDirectRun() { g_direct.fetch_add(1, std::memory_order_relaxed); }

bool GraphReplayAllowed(bool requested) {
  const char* value = std::getenv("ATTNLIB_CUDNN_GRAPH_REPLAY");
  if (value != nullptr && std::strcmp(value, "0") == 0) return false;
  if (value != nullptr && std::strcmp(value, "always") == 0) return true;
  return requested;
}

bool GraphReplay::Key::operator==(const Key& other) const {
  return size == other.size && std::memcmp(addresses.data(), other.addresses.data(), size * sizeof(void*)) == 0;
}

GraphReplay::~GraphReplay() {
  for (Captured& g : graphs_) api_.graph_exec_destroy(g.exec);  // one still running is freed when it completes
  if (capture_stream_ != nullptr) api_.stream_destroy(capture_stream_);
}

bool GraphReplay::SeenRecently(const Key& key) {
  return std::any_of(recent_.begin(), recent_.end(), [&](const Key& k) { return k.size > 0 && k == key; });
}

ffi::Error GraphReplay::CaptureGraph(const Launch& launch, cudaGraph_t* graph) {
  *graph = nullptr;
  if (capture_stream_ == nullptr) {
    if (cudaError_t err = api_.stream_create_with_flags(&capture_stream_, cudaStreamNonBlocking); err != cudaSuccess) {
      capture_stream_ = nullptr;
      return CudaFailure("cudaStreamCreateWithFlags", err);
    }
  }
  if (cudaError_t err = api_.stream_begin_capture(capture_stream_, cudaStreamCaptureModeThreadLocal);
      err != cudaSuccess) {
    return CudaFailure("cudaStreamBeginCapture", err);
  }
  ffi::Error launched = launch(capture_stream_);
  cudaError_t ended = api_.stream_end_capture(capture_stream_, graph);
  if (launched.failure() || ended != cudaSuccess || *graph == nullptr) {
    if (*graph != nullptr) api_.graph_destroy(*graph);
    *graph = nullptr;
    if (launched.failure()) return launched;
    return CudaFailure("cudaStreamEndCapture", ended);
  }
  return ffi::Error::Success();
}

ffi::Error GraphReplay::Capture(const Launch& launch, cudaGraphExec_t* exec) {
  *exec = nullptr;
  cudaGraph_t captured = nullptr;
  if (ffi::Error err = CaptureGraph(launch, &captured); err.failure()) return err;
  // The graph instantiated: cuDNN's launches issued again by us, else (unreadable) the capture itself.
  cudaGraph_t graph = captured;
  Relaunch relaunch;
  if (relaunch.Read(captured)) {
    auto issue = [&](cudaStream_t on) -> ffi::Error {
      CUresult r = relaunch.Issue(on);
      return r == CUDA_SUCCESS ? ffi::Error::Success() : DriverFailure("issuing cuDNN's launches", r);
    };
    cudaGraph_t reissued = nullptr;
    if (CaptureGraph(issue, &reissued).success()) {
      graph = reissued;
      g_reissued.fetch_add(1, std::memory_order_relaxed);
    } else {
      api_.get_last_error();
    }
  }
  cudaError_t made = api_.graph_instantiate_with_flags(exec, graph, 0);
  if (graph != captured) api_.graph_destroy(graph);
  api_.graph_destroy(captured);
  if (made != cudaSuccess) {
    *exec = nullptr;
    return CudaFailure("cudaGraphInstantiateWithFlags", made);
  }
  return ffi::Error::Success();
}

ffi::Error GraphReplay::RunIntoCapture(cudaStream_t stream, const Launch& launch) {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return launch(stream);
  cudaGraph_t captured = nullptr;
  if (CaptureGraph(launch, &captured).failure()) {
    api_.get_last_error();
    return launch(stream);
  }
  Relaunch relaunch;
  ffi::Error result = ffi::Error::Success();
  if (relaunch.Read(captured)) {
    if (CUresult r = relaunch.Issue(stream); r != CUDA_SUCCESS) {
      result = DriverFailure("issuing cuDNN's launches into XLA's command buffer", r);
    } else {
      g_reissued.fetch_add(1, std::memory_order_relaxed);
    }
  } else {
    result = launch(stream);
  }
  api_.graph_destroy(captured);
  return result;
}

ffi::Error GraphReplay::Run(cudaStream_t stream, const Key& key, const Launch& launch) {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!replay_ || !lock.owns_lock() || off_ || key.size == 0) {
    g_direct.fetch_add(1, std::memory_order_relaxed);
    return launch(stream);
  }
  ++clock_;
  auto found = std::find_if(graphs_.begin(), graphs_.end(), [&](const Captured& g) { return g.key == key; });
  if (found == graphs_.end() && captures_left_ > 0 && SeenRecently(key)) {
    cudaGraphExec_t exec = nullptr;
    if (Capture(launch, &exec).failure()) {
      // Whatever failed (a plan that cannot be captured, no memory for the graph), the direct path still works.
      api_.get_last_error();
      off_ = true;
      g_failures.fetch_add(1, std::memory_order_relaxed);
      g_direct.fetch_add(1, std::memory_order_relaxed);
      return launch(stream);
    }
    --captures_left_;
    g_captures.fetch_add(1, std::memory_order_relaxed);
    if (graphs_.size() == kMaxGraphs) {
      auto oldest = std::min_element(graphs_.begin(), graphs_.end(),
                                     [](const Captured& a, const Captured& b) { return a.last_use < b.last_use; });
      api_.graph_exec_destroy(oldest->exec);
      graphs_.erase(oldest);
    }
    graphs_.push_back({key, exec, clock_});
    found = graphs_.end() - 1;
  }
  if (found == graphs_.end()) {
    recent_[recent_next_] = key;
    recent_next_ = (recent_next_ + 1) % kRecentKeys;
    g_direct.fetch_add(1, std::memory_order_relaxed);
    return launch(stream);
  }
  found->last_use = clock_;
  if (cudaError_t err = api_.graph_launch(found->exec, stream); err != cudaSuccess) {
    api_.get_last_error();
    return CudaFailure("cudaGraphLaunch", err);
  }
  g_replays.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

}  // namespace attnlib
