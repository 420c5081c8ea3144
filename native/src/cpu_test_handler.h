// Test-only CPU handler of the FFI target `attnlib_cudnn_graph`: it hands each call's buffers and its `label` to a
// Python callback (a CPU model of the cuDNN graph), so a partitioned program that holds the real custom call can be
// compiled and run on a machine without a GPU. Never registered by attnlib itself; only tests register it.

#pragma once

#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace attnlib {

// The handler bundle (`{"execute": capsule}`) of the CPU target, after making `callback` the process's model:
// `callback(label: str, args: list[tuple[int, tuple[int, ...], bytes]], rets: list[tuple[int, tuple[int, ...]]])`
// gets each operand as (XLA FFI dtype code, dims, row-major bytes) and each result's (dtype code, dims), and returns
// one bytes object per result of exactly the result's size.
nanobind::dict CpuTestHandler(nanobind::object callback);

}  // namespace attnlib
