// One graph-agnostic XLA FFI target, `attnlib_cudnn_graph`, that runs any cuDNN graph serialized by the cuDNN
// frontend's Python API.
//
// Stages:
//   INSTANTIATE (once per executable, no device): parse and validate the blob, keep the parsed JSON.
//   INITIALIZE (every execution, outside command-buffer capture): on first use per device, create this thread's
//     cuDNN handle and deserialize the plan (shared across executables by blob), map the graph's sorted UIDs to
//     FFI operands and results, and check the workspace size. Afterwards it is a couple of atomic loads.
//   EXECUTE: set the handle's stream to XLA's, optionally zero some results, and run the plan, or replay that work
//     from a CUDA graph captured for the same buffer addresses when the call's `replay` attribute allows it
//     (graph_replay.h; ATTNLIB_CUDNN_GRAPH_REPLAY overrides the attribute). No device allocation, no
//     deserialization, no blocking lock: safe to capture into a command buffer (CUDA graph), where the plan's
//     launches are captured on a private stream and issued again into XLA's capture (graph_replay.h, relaunch.h).
// Operands are the graph's inputs in `in_uids` order; results are its outputs in `out_uids` order plus, when the plan
// needs one (`ws_bytes` > 0), a trailing uint8 workspace of at least `ws_bytes` bytes.

#include "cudnn_graph.h"

#include <cuda.h>
#include "graph_replay.h"

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <cudnn_frontend.h>

#include "xla/ffi/api/ffi.h"

namespace cudnn_frontend {
// Read by the frontend's run-time loader (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING); set by attnlib::LoadCudnn.
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace ffi = xla::ffi;
namespace fe = cudnn_frontend;

namespace attnlib {
namespace {

using json = nlohmann::json;

constexpr int kMaxDevices = 64;
constexpr char kGraphJsonVersion[] = "2.0";

// ---------------------------------------------------------------------------------------------------------------
// Loading libcudnn.

std::mutex& LoadMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

// Path of a loaded shared object whose path contains `needle`, or "".
std::string FindLoaded(const char* needle) {
  struct Search {
    const char* needle;
    std::string path;
  } search{needle, {}};
  dl_iterate_phdr(
      [](struct dl_phdr_info* info, size_t, void* data) {
        auto* s = static_cast<Search*>(data);
        if (info->dlpi_name != nullptr && std::strstr(info->dlpi_name, s->needle) != nullptr) {
          s->path = info->dlpi_name;
          return 1;
        }
        return 0;
      },
      &search);
  return search.path;
}

std::string DlError() {
  const char* e = dlerror();
  return e ? e : "unknown dlopen error";
}

// ---------------------------------------------------------------------------------------------------------------
// Per-device graphs and per-thread handles.

// A plan deserialized on one device, with the FFI buffer each of its user UIDs binds to.
struct DeviceGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  // For each user UID in the graph's sorted order: >= 0 is an operand index, < 0 is result index -(slot + 1).
  std::vector<int32_t> slots;
  int64_t workspace_bytes = 0;
};

struct GraphState {
  static ffi::TypeId id;

  std::string label;
  std::string blob;
  size_t blob_hash = 0;
  json parsed;
  std::vector<int64_t> in_uids;
  std::vector<int64_t> out_uids;
  std::vector<int64_t> zero_fill;
  int64_t ws_bytes = 0;
  bool replay = false;  // GraphReplayAllowed(the call's attribute) when it was instantiated

  std::mutex mu;
  std::array<std::atomic<DeviceGraph*>, kMaxDevices> devices{};
  std::array<std::shared_ptr<DeviceGraph>, kMaxDevices> owned;
  std::array<std::unique_ptr<GraphReplay>, kMaxDevices> replays;  // null: no CUDA graph API, run the plan directly
};

ffi::TypeId GraphState::id = {};

// Deserialized plans shared between executables that embed the same blob, per device.
struct SharedGraphKey {
  int device;
  size_t hash;
  bool operator==(const SharedGraphKey& o) const { return device == o.device && hash == o.hash; }
};
struct SharedGraphKeyHash {
  size_t operator()(const SharedGraphKey& k) const { return k.hash * 31 + static_cast<size_t>(k.device); }
};
struct SharedGraph {
  std::string blob;
  std::weak_ptr<DeviceGraph> graph;
};

std::mutex& SharedMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}
std::unordered_map<SharedGraphKey, std::vector<SharedGraph>, SharedGraphKeyHash>& SharedGraphs() {
  static auto* map = new std::unordered_map<SharedGraphKey, std::vector<SharedGraph>, SharedGraphKeyHash>;
  return *map;
}

// The CUDA runtime's graph entry points, resolved once from the runtime the frontend loaded; null when one is missing.
const CudaGraphApi* GraphApi() {
  static const CudaGraphApi* api = []() -> const CudaGraphApi* {
    try {
      auto symbol = [](const char* name) { return fe::detail::get_cuda_symbol(fe::detail::CudaLibrary::CUDART, name); };
      static CudaGraphApi resolved;
      resolved.stream_create_with_flags =
          reinterpret_cast<decltype(resolved.stream_create_with_flags)>(symbol("cudaStreamCreateWithFlags"));
      resolved.stream_destroy = reinterpret_cast<decltype(resolved.stream_destroy)>(symbol("cudaStreamDestroy"));
      resolved.stream_is_capturing =
          reinterpret_cast<decltype(resolved.stream_is_capturing)>(symbol("cudaStreamIsCapturing"));
      resolved.stream_begin_capture =
          reinterpret_cast<decltype(resolved.stream_begin_capture)>(symbol("cudaStreamBeginCapture"));
      resolved.stream_end_capture =
          reinterpret_cast<decltype(resolved.stream_end_capture)>(symbol("cudaStreamEndCapture"));
      resolved.graph_instantiate_with_flags =
          reinterpret_cast<decltype(resolved.graph_instantiate_with_flags)>(symbol("cudaGraphInstantiateWithFlags"));
      resolved.graph_destroy = reinterpret_cast<decltype(resolved.graph_destroy)>(symbol("cudaGraphDestroy"));
      resolved.graph_launch = reinterpret_cast<decltype(resolved.graph_launch)>(symbol("cudaGraphLaunch"));
      resolved.graph_exec_destroy =
          reinterpret_cast<decltype(resolved.graph_exec_destroy)>(symbol("cudaGraphExecDestroy"));
      resolved.get_last_error = reinterpret_cast<decltype(resolved.get_last_error)>(symbol("cudaGetLastError"));
      return &resolved;
    } catch (const std::exception&) {
      return nullptr;
    }
  }();
  return api;
}

// One cuDNN handle per (device, thread): `set_stream` mutates a handle. Handles live until the process exits.
thread_local std::array<cudnnHandle_t, kMaxDevices> tls_handles{};

std::string Where(const GraphState& st, const char* step) {
  return std::string("attnlib cuDNN graph '") + st.label + "', " + step + ": ";
}

ffi::Error GetHandle(const GraphState& st, int device, cudnnHandle_t* out) {
  if (device < 0 || device >= kMaxDevices) {
    return ffi::Error::InvalidArgument(Where(st, "device") + "device ordinal " + std::to_string(device) +
                                       " is outside [0, " + std::to_string(kMaxDevices) + ").");
  }
  cudnnHandle_t& h = tls_handles[device];
  if (h == nullptr) {
    cudnnStatus_t status = fe::detail::create_handle(&h);
    if (status != CUDNN_STATUS_SUCCESS) {
      h = nullptr;
      return ffi::Error::Internal(Where(st, "cudnnCreate") + "cuDNN status " + std::to_string(status) + " (" +
                                  fe::detail::get_last_error_string_() + ").");
    }
  }
  *out = h;
  return ffi::Error::Success();
}

ffi::Error FeError(const GraphState& st, const char* step, fe::error_t& status) {
  return ffi::Error::Internal(Where(st, step) + status.get_message() +
                              " (if the cuDNN library or the GPU changed since this program was compiled, clear "
                              "JAX's compilation cache and attnlib's graph cache, ATTNLIB_CACHE_DIR).");
}

// Deserializes the plan for `device` (the caller holds st.mu).
ffi::Error BuildDeviceGraph(GraphState& st, int device, cudnnHandle_t handle, cudaStream_t stream,
                            std::shared_ptr<DeviceGraph>* out) {
  {
    std::lock_guard<std::mutex> lock(SharedMutex());
    auto it = SharedGraphs().find({device, st.blob_hash});
    if (it != SharedGraphs().end()) {
      for (auto& entry : it->second) {
        if (entry.blob == st.blob) {
          if (auto existing = entry.graph.lock()) {
            *out = existing;
            return ffi::Error::Success();
          }
        }
      }
    }
  }

  auto dg = std::make_shared<DeviceGraph>();
  dg->graph = std::make_shared<fe::graph::Graph>();
  // The warm-up inside deserialize does a throw-away stream capture on the handle's stream: never XLA's stream.
  static std::array<cudaStream_t, kMaxDevices>* side_streams = new std::array<cudaStream_t, kMaxDevices>{};
  cudaStream_t& side = (*side_streams)[device];
  if (side == nullptr) {
    cudaError_t err = fe::detail::cuda_stream_create(&side);
    if (err != cudaSuccess) {
      side = nullptr;
      return ffi::Error::Internal(Where(st, "cudaStreamCreate") + "CUDA error " + std::to_string(err) + ".");
    }
  }
  if (fe::detail::set_stream(handle, side) != CUDNN_STATUS_SUCCESS) {
    return ffi::Error::Internal(Where(st, "cudnnSetStream") + fe::detail::get_last_error_string_());
  }
  fe::error_t status = dg->graph->deserialize(handle, st.parsed, /*enforce_precompiled=*/false,
                                              /*run_warmup=*/true);
  // Work queued on the side stream (warm-up) must finish before XLA's stream uses the plan.
  cudaError_t sync_err = fe::detail::cuda_stream_synchronize(side);
  fe::detail::set_stream(handle, stream);
  if (status.is_bad()) return FeError(st, "deserialize", status);
  if (sync_err != cudaSuccess) {
    return ffi::Error::Internal(Where(st, "warm-up") + "CUDA error " + std::to_string(sync_err) + ".");
  }

  status = dg->graph->get_workspace_size(dg->workspace_bytes);
  if (status.is_bad()) return FeError(st, "get_workspace_size", status);
  if (dg->workspace_bytes > st.ws_bytes) {
    return ffi::Error::Internal(Where(st, "workspace") + "the plan needs " + std::to_string(dg->workspace_bytes) +
                                " workspace bytes but the graph was built with " + std::to_string(st.ws_bytes) +
                                "; clear attnlib's graph cache (ATTNLIB_CACHE_DIR).");
  }

  for (int64_t uid : dg->graph->get_variant_pack_uids_sorted()) {
    int32_t slot = 0;
    bool found = false;
    for (size_t i = 0; i < st.in_uids.size() && !found; ++i) {
      if (st.in_uids[i] == uid) slot = static_cast<int32_t>(i), found = true;
    }
    for (size_t i = 0; i < st.out_uids.size() && !found; ++i) {
      if (st.out_uids[i] == uid) slot = -static_cast<int32_t>(i) - 1, found = true;
    }
    if (!found) {
      return ffi::Error::InvalidArgument(Where(st, "variant pack") + "the graph needs tensor uid " +
                                         std::to_string(uid) + " but the call binds neither an operand nor a result "
                                         "to it.");
    }
    dg->slots.push_back(slot);
  }

  {
    std::lock_guard<std::mutex> lock(SharedMutex());
    auto& entries = SharedGraphs()[{device, st.blob_hash}];
    entries.erase(std::remove_if(entries.begin(), entries.end(), [](const SharedGraph& e) { return e.graph.expired(); }),
                  entries.end());
    entries.push_back({st.blob, dg});
  }
  *out = std::move(dg);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// Stages.

ffi::ErrorOr<std::unique_ptr<GraphState>> Instantiate(ffi::Span<const uint8_t> graph, std::string_view label,
                                                      ffi::Span<const int64_t> in_uids,
                                                      ffi::Span<const int64_t> out_uids, int64_t ws_bytes,
                                                      ffi::Span<const int64_t> zero_fill, bool replay) {
  auto st = std::make_unique<GraphState>();
  st->label = std::string(label);
  st->blob.assign(reinterpret_cast<const char*>(graph.begin()), graph.size());
  st->blob_hash = std::hash<std::string>{}(st->blob);
  st->in_uids.assign(in_uids.begin(), in_uids.end());
  st->out_uids.assign(out_uids.begin(), out_uids.end());
  st->zero_fill.assign(zero_fill.begin(), zero_fill.end());
  st->ws_bytes = ws_bytes;
  st->replay = GraphReplayAllowed(replay);
  for (int64_t r : st->zero_fill) {
    if (r < 0 || r >= static_cast<int64_t>(st->out_uids.size())) {
      return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
          Where(*st, "instantiate") + "zero_fill index " + std::to_string(r) + " is not a graph result."));
    }
  }
  try {
    if (ffi::ErrorOr<int64_t> backend = LoadCudnn(""); backend.has_error()) {
      return ffi::Unexpected<ffi::Error>(ffi::Error::Internal(Where(*st, "loading libcudnn") +
                                                              backend.error().message()));
    }
    st->parsed = json::from_ubjson(st->blob);
    std::string json_version = st->parsed.value("json_version", std::string());
    if (json_version != kGraphJsonVersion) {
      return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
          Where(*st, "instantiate") + "graph JSON version '" + json_version + "' but this build reads '" +
          kGraphJsonVersion + "'; rebuild attnlib against the cudnn-frontend that serialized the graph."));
    }
    int64_t fe_version = st->parsed.value("cudnn_frontend_version", int64_t{-1});
    if (fe_version != CUDNN_FRONTEND_VERSION) {
      return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
          Where(*st, "instantiate") + "the graph was serialized by cudnn-frontend " + std::to_string(fe_version) +
          " but attnlib's extension was compiled against " + std::to_string(CUDNN_FRONTEND_VERSION) +
          "; install the matching nvidia-cudnn-frontend and clear JAX's compilation cache."));
    }
    std::string graph_backend = st->parsed.value("cudnn_backend_version", std::string());
    std::string loaded_backend = fe::detail::get_backend_version_string();
    if (!graph_backend.empty() && graph_backend != loaded_backend) {
      return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
          Where(*st, "instantiate") + "the graph was built for cuDNN " + graph_backend + " but this process runs " +
          loaded_backend + "; clear JAX's compilation cache and attnlib's graph cache (ATTNLIB_CACHE_DIR)."));
    }
  } catch (const std::exception& e) {
    return ffi::Unexpected<ffi::Error>(
        ffi::Error::InvalidArgument(Where(*st, "parsing the serialized graph") + e.what()));
  }
  return st;
}

ffi::Error Initialize(cudaStream_t stream, int32_t device, GraphState* st) {
  try {
    if (device < 0 || device >= kMaxDevices) {
      return ffi::Error::InvalidArgument(Where(*st, "initialize") + "device ordinal " + std::to_string(device) +
                                         " is outside [0, " + std::to_string(kMaxDevices) + ").");
    }
    cudnnHandle_t handle = nullptr;
    if (ffi::Error err = GetHandle(*st, device, &handle); err.failure()) return err;
    if (st->devices[device].load(std::memory_order_acquire) != nullptr) return ffi::Error::Success();

    std::lock_guard<std::mutex> lock(st->mu);
    if (st->devices[device].load(std::memory_order_acquire) != nullptr) return ffi::Error::Success();
    std::shared_ptr<DeviceGraph> dg;
    if (ffi::Error err = BuildDeviceGraph(*st, device, handle, stream, &dg); err.failure()) return err;
    st->owned[device] = dg;
    if (GraphApi() != nullptr) st->replays[device] = std::make_unique<GraphReplay>(*GraphApi(), st->replay);
    st->devices[device].store(dg.get(), std::memory_order_release);
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(Where(*st, "initialize") + e.what());
  }
}

ffi::Error Execute(cudaStream_t stream, int32_t device, GraphState* st, ffi::RemainingArgs args,
                   ffi::RemainingRets rets) {
  try {
    if (device < 0 || device >= kMaxDevices) {
      return ffi::Error::InvalidArgument(Where(*st, "execute") + "bad device ordinal " + std::to_string(device));
    }
    const DeviceGraph* dg = st->devices[device].load(std::memory_order_acquire);
    if (dg == nullptr) {
      return ffi::Error::Internal(Where(*st, "execute") + "the graph was not initialized on device " +
                                  std::to_string(device) + ".");
    }
    const bool has_workspace = st->ws_bytes > 0;
    const size_t n_rets = st->out_uids.size() + (has_workspace ? 1 : 0);
    if (args.size() != st->in_uids.size() || rets.size() != n_rets) {
      return ffi::Error::InvalidArgument(Where(*st, "execute") + "expected " + std::to_string(st->in_uids.size()) +
                                         " operands and " + std::to_string(n_rets) + " results" +
                                         (has_workspace ? " (the last one the workspace)" : "") + "; got " +
                                         std::to_string(args.size()) + " and " + std::to_string(rets.size()) + ".");
    }
    cudnnHandle_t handle = nullptr;
    if (ffi::Error err = GetHandle(*st, device, &handle); err.failure()) return err;

    void* workspace = nullptr;  // Initialize checked that the plan needs no more than ws_bytes
    if (has_workspace) {
      auto ws = rets.get<ffi::AnyBuffer>(st->out_uids.size());
      if (!ws.has_value()) return ffi::Error::Internal(Where(*st, "execute") + "cannot read the workspace result.");
      if (static_cast<int64_t>((*ws)->size_bytes()) < dg->workspace_bytes) {
        return ffi::Error::InvalidArgument(Where(*st, "execute") + "workspace of " +
                                           std::to_string((*ws)->size_bytes()) + " bytes, the plan needs " +
                                           std::to_string(dg->workspace_bytes) + ".");
      }
      if (dg->workspace_bytes > 0) workspace = (*ws)->untyped_data();
    }

    constexpr size_t kMaxSlots = 32;
    void* ptrs[kMaxSlots];
    const size_t n = dg->slots.size();
    if (n > kMaxSlots) return ffi::Error::Internal(Where(*st, "execute") + "too many graph tensors.");
    GraphReplay::Key key;
    for (size_t i = 0; i < n; ++i) {
      int32_t slot = dg->slots[i];
      if (slot >= 0) {
        auto arg = args.get<ffi::AnyBuffer>(slot);
        if (!arg.has_value()) return ffi::Error::Internal(Where(*st, "execute") + "cannot read an operand.");
        ptrs[i] = arg->untyped_data();
      } else {
        auto ret = rets.get<ffi::AnyBuffer>(-slot - 1);
        if (!ret.has_value()) return ffi::Error::Internal(Where(*st, "execute") + "cannot read a result.");
        ptrs[i] = (*ret)->untyped_data();
      }
      key.addresses[key.size++] = ptrs[i];
    }
    key.addresses[key.size++] = workspace;
    if (st->zero_fill.size() > kMaxSlots) return ffi::Error::Internal(Where(*st, "execute") + "too many results.");
    std::array<std::pair<void*, size_t>, kMaxSlots> zero;  // (result, bytes) of the results to zero
    const size_t n_zero = st->zero_fill.size();
    for (size_t z = 0; z < n_zero; ++z) {
      auto ret = rets.get<ffi::AnyBuffer>(st->zero_fill[z]);
      if (!ret.has_value()) return ffi::Error::Internal(Where(*st, "execute") + "cannot read a result.");
      zero[z] = {(*ret)->untyped_data(), (*ret)->size_bytes()};
      if (key.size < GraphReplay::kMaxAddresses) {
        key.addresses[key.size++] = (*ret)->untyped_data();
      } else {
        key.size = 0;  // never replayed
      }
    }
    auto launch = [&](cudaStream_t on) -> ffi::Error {
      for (size_t z = 0; z < n_zero; ++z) {
        const auto& [data, bytes] = zero[z];
        cudaError_t err = fe::detail::cuda_mem_set_async(data, 0, bytes, on);
        if (err != cudaSuccess) {
          return ffi::Error::Internal(Where(*st, "cudaMemsetAsync") + "CUDA error " + std::to_string(err) + ".");
        }
      }
      if (fe::detail::set_stream(handle, on) != CUDNN_STATUS_SUCCESS) {
        return ffi::Error::Internal(Where(*st, "cudnnSetStream") + fe::detail::get_last_error_string_());
      }
      fe::error_t status = dg->graph->execute(handle, ptrs, static_cast<int>(n), workspace);
      if (status.is_bad()) return FeError(*st, "execute", status);
      return ffi::Error::Success();
    };
    GraphReplay* replay = st->replays[device].get();
    if (const CudaGraphApi* api = GraphApi(); api != nullptr && CapturedByXla(*api, stream)) {
      return replay != nullptr ? replay->RunIntoCapture(stream, launch) : launch(stream);
    }
    if (replay == nullptr) {
      CountDirectRun();
      return launch(stream);
    }
    return replay->Run(stream, key, launch);
  } catch (const std::exception& e) {
    return ffi::Error::Internal(Where(*st, "execute") + e.what());
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Utilities for the Python module.

int FrontendVersion() { return CUDNN_FRONTEND_VERSION; }

#ifndef ATTNLIB_JAXLIB_VERSION
#define ATTNLIB_JAXLIB_VERSION ""
#endif

BuildInfo GetBuildInfo() {
  return BuildInfo{CUDNN_FRONTEND_VERSION, CUDNN_VERSION, CUDA_VERSION, XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR,
                   ATTNLIB_JAXLIB_VERSION};
}

std::string GraphJsonVersion() { return kGraphJsonVersion; }

ffi::ErrorOr<std::string> CanonicalizeGraph(const std::string& blob) {
  const std::string prefix = "not a serialized cuDNN graph: ";
  try {
    json j = json::from_ubjson(blob);
    if (!j.is_object()) {
      return ffi::Unexpected(ffi::Error::InvalidArgument(prefix + "the serialized graph is not a UBJSON object"));
    }
    if (j.contains("gid")) j["gid"] = 0;
    std::vector<uint8_t> bytes = json::to_ubjson(j);
    return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  } catch (const std::exception& e) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(prefix + e.what()));
  }
}

ffi::ErrorOr<GraphVersionInfo> GraphVersions(const std::string& blob) {
  try {
    json j = json::from_ubjson(blob);
    GraphVersionInfo info;
    info.json_version = j.value("json_version", std::string());
    info.frontend_version = j.value("cudnn_frontend_version", int64_t{-1});
    info.backend_version = j.value("cudnn_backend_version", std::string());
    return info;
  } catch (const std::exception& e) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string("not a serialized cuDNN graph: ") + e.what()));
  }
}

ffi::ErrorOr<int64_t> LoadCudnn(const std::string& hint) {
  std::lock_guard<std::mutex> lock(LoadMutex());
  if (fe::cudnn_dlhandle == nullptr) {
    void* h = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) {
      std::string loaded = FindLoaded("/libcudnn.so");
      if (!loaded.empty()) h = dlopen(loaded.c_str(), RTLD_NOW | RTLD_NOLOAD);
    }
    if (h == nullptr && !hint.empty()) h = dlopen(hint.c_str(), RTLD_NOW);
    if (h == nullptr) h = dlopen("libcudnn.so.9", RTLD_NOW);
    if (h == nullptr) {
      return ffi::Unexpected(ffi::Error::Internal(
          "cannot load libcudnn.so.9 (" + DlError() +
          "); install nvidia-cudnn-cu13 (or cu12) and initialise JAX's CUDA backend first"));
    }
    fe::cudnn_dlhandle = h;
    // The frontend's CUDA-runtime loader tries libcudart.so.12 before .13: use the runtime this process already has.
    if (std::getenv("CUDNN_FRONTEND_CUDART_LIB_NAME") == nullptr) {
      std::string cudart = FindLoaded("/libcudart.so");
      if (!cudart.empty()) setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", cudart.c_str(), 0);
    }
  }
  try {
    return static_cast<int64_t>(fe::detail::get_backend_version());
  } catch (const std::exception& e) {
    return ffi::Unexpected(ffi::Error::Internal(e.what()));
  }
}

namespace {

// A failed CUDA call as an Internal error (Success for cudaSuccess). Clears CUDA's sticky last error: our own failure
// (e.g. out of memory next to JAX's pool) must not linger for the next cudaGetLastError caller.
ffi::Error CudaError(cudaError_t err, const char* step) {
  if (err == cudaSuccess) return ffi::Error::Success();
  fe::detail::cuda_get_last_error();
  return ffi::Error::Internal(std::string(step) + ": CUDA error " + std::to_string(static_cast<int>(err)));
}

// TimeGraph without the common message prefix.
ffi::ErrorOr<double> TimeGraphUnprefixed(const std::string& blob, const std::vector<TimedTensor>& tensors,
                                         int64_t ws_bytes, int repeats, int batch) {
  // Everything acquired is released by this guard, whichever step fails.
  struct Resources {
    cudnnHandle_t handle = nullptr;
    cudaStream_t stream = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr;
    std::vector<void*> buffers;
    ~Resources() {
      if (stream != nullptr) fe::detail::cuda_stream_synchronize(stream);
      for (void* p : buffers) fe::detail::cuda_free(p);
      if (start != nullptr) fe::detail::cuda_event_destroy(start);
      if (stop != nullptr) fe::detail::cuda_event_destroy(stop);
      if (handle != nullptr) fe::detail::destroy_handle(handle);
      if (stream != nullptr) fe::detail::cuda_stream_destroy(stream);
    }
  } r;
  using Failed = ffi::Unexpected<ffi::Error>;
  try {
    if (ffi::ErrorOr<int64_t> loaded = LoadCudnn(""); loaded.has_error()) return Failed(loaded.error());
    if (repeats < 1 || batch < 1) return Failed(ffi::Error::InvalidArgument("repeats and batch must be at least 1"));
    if (fe::detail::create_handle(&r.handle) != CUDNN_STATUS_SUCCESS) {
      r.handle = nullptr;
      return Failed(ffi::Error::Internal("cudnnCreate: " + fe::detail::get_last_error_string_()));
    }
    if (ffi::Error e = CudaError(fe::detail::cuda_stream_create(&r.stream), "cudaStreamCreate"); e.failure()) {
      return Failed(e);
    }
    if (ffi::Error e = CudaError(fe::detail::cuda_event_create(&r.start), "cudaEventCreate"); e.failure()) {
      return Failed(e);
    }
    if (ffi::Error e = CudaError(fe::detail::cuda_event_create(&r.stop), "cudaEventCreate"); e.failure()) {
      return Failed(e);
    }
    if (fe::detail::set_stream(r.handle, r.stream) != CUDNN_STATUS_SUCCESS) {
      return Failed(ffi::Error::Internal("cudnnSetStream: " + fe::detail::get_last_error_string_()));
    }
    json parsed;
    try {
      parsed = json::from_ubjson(blob);
    } catch (const std::exception& e) {
      return Failed(ffi::Error::InvalidArgument(e.what()));
    }
    fe::graph::Graph graph;
    fe::error_t status = graph.deserialize(r.handle, parsed, /*enforce_precompiled=*/false, /*run_warmup=*/false);
    if (status.is_bad()) return Failed(ffi::Error::Internal("deserialize: " + status.get_message()));
    int64_t needed = 0;
    status = graph.get_workspace_size(needed);
    if (status.is_bad()) return Failed(ffi::Error::Internal("get_workspace_size: " + status.get_message()));
    std::unordered_map<int64_t, void*> pointers;
    for (const TimedTensor& t : tensors) {
      void* p = nullptr;
      if (ffi::Error e = CudaError(fe::detail::cuda_malloc(&p, static_cast<size_t>(std::max<int64_t>(t.bytes, 1))),
                                   "cudaMalloc");
          e.failure()) {
        return Failed(e);
      }
      r.buffers.push_back(p);
      pointers[t.uid] = p;
      if (t.contents.empty()) {
        if (ffi::Error e = CudaError(fe::detail::cuda_mem_set_async(p, 0, static_cast<size_t>(t.bytes), r.stream),
                                     "cudaMemset");
            e.failure()) {
          return Failed(e);
        }
      } else {
        if (static_cast<int64_t>(t.contents.size()) > t.bytes) {
          return Failed(ffi::Error::InvalidArgument("contents of tensor uid " + std::to_string(t.uid) +
                                                    " exceed its size"));
        }
        if (ffi::Error e = CudaError(fe::detail::cuda_mem_cpy_async(p, t.contents.data(), t.contents.size(),
                                                                    cudaMemcpyHostToDevice, r.stream),
                                     "cudaMemcpy");
            e.failure()) {
          return Failed(e);
        }
        if (ffi::Error e = CudaError(fe::detail::cuda_stream_synchronize(r.stream), "cudaStreamSynchronize");
            e.failure()) {
          return Failed(e);
        }
      }
    }
    void* workspace = nullptr;
    int64_t ws = std::max(ws_bytes, needed);
    if (ws > 0) {
      if (ffi::Error e = CudaError(fe::detail::cuda_malloc(&workspace, static_cast<size_t>(ws)), "cudaMalloc");
          e.failure()) {
        return Failed(e);
      }
      r.buffers.push_back(workspace);
    }
    std::vector<void*> ptrs;
    for (int64_t uid : graph.get_variant_pack_uids_sorted()) {
      auto it = pointers.find(uid);
      if (it == pointers.end()) {
        return Failed(ffi::Error::InvalidArgument("the graph needs tensor uid " + std::to_string(uid) +
                                                  " but no buffer was described for it"));
      }
      ptrs.push_back(it->second);
    }
    auto run = [&]() -> ffi::Error {
      fe::error_t s = graph.execute(r.handle, ptrs.data(), static_cast<int>(ptrs.size()), workspace);
      if (s.is_bad()) return ffi::Error::Internal("execute: " + s.get_message());
      return ffi::Error::Success();
    };
    if (ffi::Error e = run(); e.failure()) return Failed(e);
    if (ffi::Error e = CudaError(fe::detail::cuda_stream_synchronize(r.stream), "warm-up"); e.failure()) {
      return Failed(e);
    }
    float best = std::numeric_limits<float>::infinity();
    for (int rep = 0; rep < repeats; ++rep) {
      if (ffi::Error e = CudaError(fe::detail::cuda_event_record(r.start, r.stream), "cudaEventRecord"); e.failure()) {
        return Failed(e);
      }
      for (int i = 0; i < batch; ++i) {
        if (ffi::Error e = run(); e.failure()) return Failed(e);
      }
      if (ffi::Error e = CudaError(fe::detail::cuda_event_record(r.stop, r.stream), "cudaEventRecord"); e.failure()) {
        return Failed(e);
      }
      if (ffi::Error e = CudaError(fe::detail::cuda_event_synchronize(r.stop), "cudaEventSynchronize"); e.failure()) {
        return Failed(e);
      }
      float ms = 0.0f;
      if (ffi::Error e = CudaError(fe::detail::cuda_event_elapsed_time(&ms, r.start, r.stop), "cudaEventElapsedTime");
          e.failure()) {
        return Failed(e);
      }
      best = std::min(best, ms / static_cast<float>(batch));
    }
    return static_cast<double>(best);
  } catch (const std::exception& e) {
    return Failed(ffi::Error::Internal(e.what()));
  }
}

}  // namespace

ffi::ErrorOr<double> TimeGraph(const std::string& blob, const std::vector<TimedTensor>& tensors, int64_t ws_bytes,
                               int repeats, int batch) {
  ffi::ErrorOr<double> ms = TimeGraphUnprefixed(blob, tensors, ws_bytes, repeats, batch);
  if (ms.has_value()) return ms;
  const ffi::Error& e = ms.error();
  return ffi::Unexpected(
      ffi::Error(e.errc().value_or(ffi::ErrorCode::kInternal), "timing the cuDNN graph failed: " + e.message()));
}

}  // namespace attnlib

// ---------------------------------------------------------------------------------------------------------------
// Handler symbols.

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnlibCudnnGraphInstantiate, attnlib::Instantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Attr<ffi::Span<const uint8_t>>("graph")  // serialized cuDNN graph (UBJSON)
                                  .Attr<std::string_view>("label")          // graph name for error messages
                                  .Attr<ffi::Span<const int64_t>>("in_uids")    // tensor uid of each operand
                                  .Attr<ffi::Span<const int64_t>>("out_uids")   // tensor uid of each result
                                  .Attr<int64_t>("ws_bytes")                    // workspace size at build time
                                  .Attr<ffi::Span<const int64_t>>("zero_fill")  // results to zero before running
                                  .Attr<bool>("replay")  // the call may be replayed from a captured CUDA graph
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnlibCudnnGraphInitialize, attnlib::Initialize,
                              ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<attnlib::GraphState>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnlibCudnnGraphExecute, attnlib::Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<attnlib::GraphState>>()
                                  .RemainingArgs()   // graph inputs, in in_uids order
                                  .RemainingRets(),  // graph outputs in out_uids order, then any workspace
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnlibCudnnGraphExecuteNoCmdBuffer, attnlib::Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<attnlib::GraphState>>()
                                  .RemainingArgs()    // graph inputs, in in_uids order
                                  .RemainingRets());  // graph outputs in out_uids order, then any workspace

extern "C" XLA_FFI_TypeId* AttnlibGraphStateTypeId() { return &attnlib::GraphState::id; }

extern "C" const XLA_FFI_TypeInfo* AttnlibGraphStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<attnlib::GraphState>();
  return &info;
}
