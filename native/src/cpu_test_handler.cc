// Test-only CPU handler of `attnlib_cudnn_graph` (see cpu_test_handler.h).

#include "cpu_test_handler.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace attnlib {
namespace {

// The Python model. Leaked on purpose: a static nb::object would be destroyed after the interpreter has gone.
nb::object* model = nullptr;

nb::tuple Dims(ffi::Span<const int64_t> dims) {
  nb::list out;
  for (int64_t d : dims) out.append(d);
  return nb::tuple(out);
}

ffi::Error CpuExecuteImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  ffi::ErrorOr<std::string_view> label = attrs.get<std::string_view>("label");
  if (!label.has_value()) return ffi::Error::InvalidArgument("attnlib CPU test handler: the call has no `label`.");
  nb::gil_scoped_acquire gil;
  if (model == nullptr) return ffi::Error::Internal("attnlib CPU test handler: no Python model was installed.");
  try {
    nb::list operands;
    for (size_t i = 0; i < args.size(); ++i) {
      ffi::ErrorOr<ffi::AnyBuffer> arg = args.get<ffi::AnyBuffer>(i);
      if (!arg.has_value()) return arg.error();
      const char* data = static_cast<const char*>(arg->untyped_data());
      operands.append(nb::make_tuple(static_cast<int>(arg->element_type()), Dims(arg->dimensions()),
                                     nb::bytes(data, arg->size_bytes())));
    }
    nb::list results;
    for (size_t i = 0; i < rets.size(); ++i) {
      ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(i);
      if (!ret.has_value()) return ret.error();
      results.append(nb::make_tuple(static_cast<int>((*ret)->element_type()), Dims((*ret)->dimensions())));
    }
    nb::object produced = (*model)(nb::str(label->data(), label->size()), operands, results);
    nb::list values(produced);
    if (values.size() != rets.size()) {
      return ffi::Error::Internal("attnlib CPU test handler: the model returned " + std::to_string(values.size()) +
                                  " results; the call has " + std::to_string(rets.size()) + ".");
    }
    for (size_t i = 0; i < rets.size(); ++i) {
      ffi::Result<ffi::AnyBuffer> ret = rets.get<ffi::AnyBuffer>(i).value();
      nb::bytes value = nb::cast<nb::bytes>(values[i]);
      if (value.size() != ret->size_bytes()) {
        return ffi::Error::Internal("attnlib CPU test handler: result " + std::to_string(i) + " has " +
                                    std::to_string(ret->size_bytes()) + " bytes; the model returned " +
                                    std::to_string(value.size()) + ".");
      }
      std::memcpy(ret->untyped_data(), value.c_str(), value.size());
    }
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("attnlib CPU test handler: the Python model raised: ") + e.what());
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnlibCpuTestExecute, CpuExecuteImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()  // the graph's inputs, in `in_uids` order
                                  .RemainingRets()  // the graph's outputs, then the workspace
                                  .Attrs());        // label (the rest are the GPU executor's)

}  // namespace

nb::dict CpuTestHandler(nb::object callback) {
  nb::gil_scoped_acquire gil;
  if (model == nullptr) model = new nb::object();
  *model = std::move(callback);
  nb::dict handlers;
  handlers["execute"] = nb::capsule(reinterpret_cast<void*>(AttnlibCpuTestExecute));
  return handlers;
}

}  // namespace attnlib
