// Python module `attnlib._attnlib_ffi`: the FFI handler capsules of target `attnlib_cudnn_graph`, its state type, and
// helpers the graph builder uses (blob canonicalization, version checks).

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_test_handler.h"
#include "cudnn_graph.h"
#include "graph_replay.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::bytes ToBytes(const std::string& s) { return nb::bytes(s.data(), s.size()); }

std::string FromBytes(nb::bytes b) { return std::string(b.c_str(), b.size()); }

// The one place a helper's error becomes a Python exception: ValueError for InvalidArgument (bad input), RuntimeError
// for everything else (libcudnn, CUDA or cuDNN failures). The message is the error's, unchanged.
template <typename T>
T ValueOrThrow(xla::ffi::ErrorOr<T> result) {
  if (result.has_value()) return std::move(result).value();
  const xla::ffi::Error& error = result.error();
  if (error.errc() == xla::ffi::ErrorCode::kInvalidArgument) throw std::invalid_argument(error.message());
  throw std::runtime_error(error.message());
}

}  // namespace

NB_MODULE(_attnlib_ffi, m) {
  m.doc() = "attnlib's native XLA FFI extension: executes serialized cuDNN graphs.";

  m.def(
      "registrations",
      [](bool command_buffer) {
        nb::dict handlers;
        handlers["instantiate"] = Capsule(AttnlibCudnnGraphInstantiate);
        handlers["initialize"] = Capsule(AttnlibCudnnGraphInitialize);
        handlers["execute"] =
            command_buffer ? Capsule(AttnlibCudnnGraphExecute) : Capsule(AttnlibCudnnGraphExecuteNoCmdBuffer);
        nb::dict out;
        out["attnlib_cudnn_graph"] = handlers;
        return out;
      },
      nb::arg("command_buffer") = true,
      "FFI handler bundles by target name; `command_buffer` marks execute capturable into CUDA graphs.");

  m.def("cpu_test_handler", &attnlib::CpuTestHandler, nb::arg("callback"),
        "TESTS ONLY: the CPU handler bundle of `attnlib_cudnn_graph`, which runs each call through "
        "`callback(label, args, rets)` (a CPU model of the graph); attnlib never registers it itself.");

  m.def(
      "state_type",
      []() {
        nb::dict type;
        type["type_id"] = nb::capsule(reinterpret_cast<void*>(AttnlibGraphStateTypeId()));
        type["type_info"] = nb::capsule(const_cast<void*>(static_cast<const void*>(AttnlibGraphStateTypeInfo())));
        return type;
      },
      "The FFI state type of `attnlib_cudnn_graph`, for `jax.ffi.register_ffi_type`.");

  m.def(
      "graph_replay_counts",
      []() {
        attnlib::GraphReplayCounts c = attnlib::ReadGraphReplayCounts();
        nb::dict out;
        out["captures"] = c.captures;
        out["replays"] = c.replays;
        out["direct"] = c.direct;
        out["failures"] = c.failures;
        out["xla_records"] = c.xla_records;
        out["reissued"] = c.reissued;
        return out;
      },
      "Process-wide counts of graph executions: captured into a CUDA graph, replayed from one, run directly, failed "
      "captures, run while XLA captured them into its command buffer, and captures whose launches attnlib issued "
      "again itself.");

  m.def("frontend_version", &attnlib::FrontendVersion,
        "CUDNN_FRONTEND_VERSION of the headers this module was compiled against (13200 for 1.32.0).");

  m.def(
      "build_info",
      [] {
        attnlib::BuildInfo info = attnlib::GetBuildInfo();
        nb::dict d;
        d["cudnn_frontend"] = info.frontend;
        d["cudnn"] = info.cudnn;
        d["cuda"] = info.cuda;
        d["xla_ffi_api"] = nb::make_tuple(info.xla_ffi_major, info.xla_ffi_minor);
        d["jaxlib"] = info.jaxlib;
        return d;
      },
      "Versions of the headers this module was compiled against: cudnn_frontend, cudnn and cuda as integers "
      "(13200, 91900, 13000), xla_ffi_api as (major, minor), jaxlib as a string.");

  m.def("graph_json_version", &attnlib::GraphJsonVersion, "The serialized-graph JSON version this module reads.");

  m.def(
      "canonicalize_graph",
      [](nb::bytes blob) { return ToBytes(ValueOrThrow(attnlib::CanonicalizeGraph(FromBytes(blob)))); },
      nb::arg("blob"), "The blob with its process-dependent graph id zeroed, so equal graphs give equal bytes.");

  m.def(
      "graph_versions",
      [](nb::bytes blob) {
        attnlib::GraphVersionInfo info = ValueOrThrow(attnlib::GraphVersions(FromBytes(blob)));
        return std::make_tuple(info.json_version, info.frontend_version, info.backend_version);
      },
      nb::arg("blob"), "(json_version, cudnn_frontend_version, cudnn_backend_version) recorded in a blob.");

  m.def(
      "load_cudnn", [](const std::string& hint) { return ValueOrThrow(attnlib::LoadCudnn(hint)); },
      nb::arg("hint") = "",
      "Binds the extension to libcudnn (the copy already loaded, else `hint`, else the soname); returns its version.");

  m.def(
      "time_graph",
      [](nb::bytes blob, const std::vector<std::tuple<int64_t, int64_t, nb::bytes>>& tensors, int64_t ws_bytes,
         int repeats, int batch) {
        std::string graph = FromBytes(blob);
        std::vector<attnlib::TimedTensor> described;
        for (const auto& [uid, bytes, contents] : tensors) described.push_back({uid, bytes, FromBytes(contents)});
        xla::ffi::ErrorOr<double> ms = [&] {
          nb::gil_scoped_release release;
          return attnlib::TimeGraph(graph, described, ws_bytes, repeats, batch);
        }();
        return ValueOrThrow(std::move(ms));
      },
      nb::arg("blob"), nb::arg("tensors"), nb::arg("ws_bytes"), nb::arg("repeats") = 3, nb::arg("batch") = 5,
      "Best milliseconds of one execution of a serialized graph on fresh buffers of the current device. `tensors` "
      "lists (uid, bytes, contents) for every graph tensor; empty contents means zeros.");
}
