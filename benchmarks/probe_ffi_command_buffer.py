"""Probe (issue 17): does XLA launch a command buffer more slowly when it holds *any* FFI call?

With `xla_gpu_graph_min_graph_size=1` the host's `cuGraphLaunch` of a decode layer holding attnlib's cuDNN call
takes about the layer's device time, against 14 µs for the one holding XLA's own cuDNN command
(`docs/performance.md`, "Inside XLA's command buffers the launch of attnlib's call waits"). This probe takes cuDNN
and attnlib out: it compiles a trivial FFI target (`nvcc`, XLA's FFI headers) that copies its operand, optionally
spinning a fixed time on the device, and times a 32-layer `lax.scan` whose body is a fusion, that call and a fusion,
against the same loop without the call. Every variant runs with XLA's default flags and with the minimum graph size
1, and is profiled: device busy / idle per step, the host's `cuGraphLaunch` per layer and where the device idles.

Variants (the spin: `--heavy-us` on the device, about a b1 · 32k decode layer's time):
  xla_light            fusion(x) -> convert                                  no FFI call (host-bound)
  ffi_copy_light       fusion(x) -> ffi copy -> convert                      a trivial FFI call (host-bound)
  ffi_spin             fusion(x) -> ffi copy + spin -> convert               the layer's time inside the FFI call
  ffi_state_spin       as ffi_spin, the target with instantiate + initialize stages and a state (as attnlib's)
  ffi_blob_spin        as ffi_spin, with a 128 KB attribute (as attnlib's serialized graph); ffi_blob1m_spin: 1 MB;
                       ffi_blob_light / ffi_blob1m_light: the same without the spin
  ffi_many_spin        as ffi_spin through a target with remaining operands / results; ffi_cache_spin: also given
                       a decode layer's K and V (64 MB each, jit arguments as attnlib's, unread); ffi_workspace_spin:
                       a second, 1 MB result (as attnlib's workspace); ffi_cache_workspace_spin: both
  ffi_cudnn_shaped_spin as ffi_spin, launched as cuDNN's decode kernels: the spin on grid {8, 8} x 128 threads with
                       86336 B of dynamic shared memory, then a second kernel on {1, 32} x 256 with 4160 B
  ffi_cluster_spin     as ffi_cudnn_shaped_spin, the spin launched with clusters of {1, 1, 1}; ffi_pdl_spin: the
                       second kernel a programmatic dependent launch (griddepcontrol.wait); ffi_cluster_pdl_spin: both
  ffi_module_spin      as ffi_spin, the kernel from a cubin loaded at run time (cuModuleLoadData, as cuDNN's
                       generated kernels); ffi_library_spin: through cuLibraryLoadData

Usage: python benchmarks/probe_ffi_command_buffer.py [--heavy-us 30] [--layers 32] [--only VARIANT ...]
       [--repeat N]  (each variant N times, in turn: the spread between runs)
"""

import argparse
import ctypes
import glob
import os
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from bench_cudnn import best_per_call  # run as a script: benchmarks/ is on sys.path
from jaxlib import xla_client
from kernel_profile import pipelined_profile


SPIN_BODY = r"""(const uint16_t* x, uint16_t* y, int64_t n, int64_t spin_ns) {
  uint64_t start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = x[i];
  if (spin_ns > 0) {
    uint64_t now;
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < (uint64_t)spin_ns);
  }
}"""  # the copy (+ spin) kernel's parameters and body: compiled into the FFI library and, alone, into a cubin

SOURCE = r"""
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <cuda.h>
#include <cuda_runtime.h>
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;

__global__ void CopySpin SPIN_BODY

static ffi::Error Launch(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t spin_ns) {
  CopySpin<<<1, 256, 0, stream>>>(static_cast<const uint16_t*>(x.untyped_data()),
                                  static_cast<uint16_t*>(y->untyped_data()), (int64_t)x.element_count(), spin_ns);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}

static ffi::Error Plain(cudaStream_t s, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t spin_ns,
                        ffi::Span<const uint8_t>) {
  return Launch(s, x, y, spin_ns);
}

struct ProbeState {
  static ffi::TypeId id;
  int64_t spin_ns = 0;
};
ffi::TypeId ProbeState::id = {};

static ffi::ErrorOr<std::unique_ptr<ProbeState>> Instantiate(int64_t spin_ns, ffi::Span<const uint8_t>) {
  auto st = std::make_unique<ProbeState>();
  st->spin_ns = spin_ns;
  return std::move(st);
}
static ffi::Error Initialize(cudaStream_t, ProbeState*) { return ffi::Error::Success(); }
static ffi::Error Stateful(cudaStream_t s, ProbeState* st, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  return Launch(s, x, y, st->spin_ns);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbePlain, Plain,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
        .Attr<int64_t>("spin_ns").Attr<ffi::Span<const uint8_t>>("blob"),
    {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeInstantiate, Instantiate,
    ffi::Ffi::BindInstantiate().Attr<int64_t>("spin_ns").Attr<ffi::Span<const uint8_t>>("blob"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeInitialize, Initialize,
    ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>().Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::State<ProbeState>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeStateful, Stateful,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::State<ProbeState>>()
        .Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>(),
    {ffi::Traits::kCmdBufferCompatible});

static ffi::Error Many(cudaStream_t s, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t spin_ns) {
  auto x = args.get<ffi::AnyBuffer>(0);
  auto y = rets.get<ffi::AnyBuffer>(0);
  if (x.has_error() || y.has_error()) return ffi::Error::InvalidArgument("probe_many: bad operand or result");
  return Launch(s, *x, *y, spin_ns);
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeMany, Many,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().RemainingArgs().RemainingRets()
        .Attr<int64_t>("spin_ns"),
    {ffi::Traits::kCmdBufferCompatible});

// cuDNN's decode launch: its SDPA kernel on grid {8, 8} x 128 threads with 86336 bytes of dynamic shared memory,
// then its split reduction on grid {1, 32} x 256 threads with 4160 bytes (the kernels of the decode call's graph).
__global__ void WideSpin(const uint16_t* x, uint16_t* y, int64_t n, int64_t spin_ns) {
  extern __shared__ char smem[];
  uint64_t start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  int64_t block = blockIdx.y * gridDim.x + blockIdx.x, blocks = gridDim.x * gridDim.y;
  for (int64_t i = block * blockDim.x + threadIdx.x; i < n; i += blocks * blockDim.x) y[i] = x[i];
  smem[threadIdx.x] = 0;
  if (spin_ns > 0) {
    uint64_t now;
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < (uint64_t)spin_ns);
  }
}
__global__ void Tail(uint16_t* y) {
  extern __shared__ char smem[];
  smem[threadIdx.x] = 0;
  if (blockIdx.x + blockIdx.y + threadIdx.x == 0) y[0] = y[0];
}
// `cluster`: the spin launched with a cluster dimension of {1, 1, 1} (cuDNN's kernel name says cga1x1x1); `pdl`:
// the second kernel launched as a programmatic dependent launch, waiting on the first with griddepcontrol.
__global__ void PdlTail(uint16_t* y) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  extern __shared__ char smem[];
  smem[threadIdx.x] = 0;
  if (blockIdx.x + blockIdx.y + threadIdx.x == 0) y[0] = y[0];
}
static ffi::Error CudnnShaped(cudaStream_t s, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t spin_ns,
                              bool cluster, bool pdl) {
  static const cudaError_t attr = cudaFuncSetAttribute(WideSpin, cudaFuncAttributeMaxDynamicSharedMemorySize, 86336);
  if (attr != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(attr));
  const uint16_t* in = static_cast<const uint16_t*>(x.untyped_data());
  auto* out = static_cast<uint16_t*>(y->untyped_data());
  int64_t n = (int64_t)x.element_count();
  cudaLaunchAttribute attrs[1];
  cudaLaunchConfig_t config = {dim3(8, 8), dim3(128), 86336, s, attrs, 0};
  if (cluster) {
    attrs[0].id = cudaLaunchAttributeClusterDimension;
    attrs[0].val.clusterDim.x = attrs[0].val.clusterDim.y = attrs[0].val.clusterDim.z = 1;
    config.numAttrs = 1;
  }
  cudaError_t e = cudaLaunchKernelEx(&config, WideSpin, in, out, n, spin_ns);
  if (e != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(e));
  cudaLaunchConfig_t tail = {dim3(1, 32), dim3(256), 4160, s, attrs, 0};
  if (pdl) {
    attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[0].val.programmaticStreamSerializationAllowed = 1;
    tail.numAttrs = 1;
  }
  e = pdl ? cudaLaunchKernelEx(&tail, PdlTail, out) : cudaLaunchKernelEx(&tail, Tail, out);
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeCudnnShaped, CudnnShaped,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
        .Attr<int64_t>("spin_ns").Attr<bool>("cluster").Attr<bool>("pdl"),
    {ffi::Traits::kCmdBufferCompatible});

// The copy + spin kernel from a cubin loaded at run time (as cuDNN loads its generated kernels): through
// cuModuleLoadData (`module`) or cuLibraryLoadData (`library`), launched with cuLaunchKernel.
static CUfunction loaded[2] = {nullptr, nullptr};
static decltype(&cuLaunchKernel) launch_kernel = nullptr;
template <typename F>
static bool Entry(const char* name, F* fn) {  // the driver's function through the runtime (no -lcuda)
  cudaDriverEntryPointQueryResult found;
  void* p = nullptr;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) != cudaSuccess) return false;
  *fn = reinterpret_cast<F>(p);
  return found == cudaDriverEntryPointSuccess;
}
extern "C" int ProbeLoadCubin(const void* image) {
  if (cudaFree(nullptr) != cudaSuccess) return 1;
  decltype(&cuModuleLoadData) module_load;
  decltype(&cuModuleGetFunction) module_function;
  decltype(&cuLibraryLoadData) library_load;
  decltype(&cuLibraryGetKernel) library_kernel;
  if (!Entry("cuModuleLoadData", &module_load) || !Entry("cuModuleGetFunction", &module_function) ||
      !Entry("cuLibraryLoadData", &library_load) || !Entry("cuLibraryGetKernel", &library_kernel) ||
      !Entry("cuLaunchKernel", &launch_kernel))
    return 2;
  CUmodule module;
  CUlibrary library;
  CUkernel kernel;
  if (module_load(&module, image) != CUDA_SUCCESS) return 3;
  if (module_function(&loaded[0], module, "LoadedSpin") != CUDA_SUCCESS) return 4;
  if (library_load(&library, image, nullptr, nullptr, 0, nullptr, nullptr, 0) != CUDA_SUCCESS) return 5;
  if (library_kernel(&kernel, library, "LoadedSpin") != CUDA_SUCCESS) return 6;
  loaded[1] = reinterpret_cast<CUfunction>(kernel);
  return 0;
}
static ffi::Error Loaded(cudaStream_t s, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t spin_ns,
                         int64_t which) {
  if (which < 0 || which > 1 || !loaded[which]) return ffi::Error::InvalidArgument("probe_loaded: cubin not loaded");
  const void* in = x.untyped_data();
  void* out = y->untyped_data();
  int64_t n = (int64_t)x.element_count();
  void* params[] = {&in, &out, &n, &spin_ns};
  CUresult r = launch_kernel(loaded[which], 1, 1, 1, 256, 1, 1, 0, s, params, nullptr);
  return r == CUDA_SUCCESS ? ffi::Error::Success() : ffi::Error::Internal("probe_loaded: cuLaunchKernel failed");
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeLoaded, Loaded,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
        .Attr<int64_t>("spin_ns").Attr<int64_t>("which"),
    {ffi::Traits::kCmdBufferCompatible});

// The copy captured once into a CUDA graph the first time a pair of addresses comes, launched with cudaGraphLaunch
// after (as attnlib's replay of short calls), for `probe_call_floor.py`. `nodes`: 0, the copy kernel alone; 1, a
// 256-byte memset before it (as cuDNN's graphs); 2, the copy with a 4000-byte parameter block (cuDNN's kernels take
// large ones); 3, both.
struct BigParams {
  char bytes[4000];
};
__global__ void CopyBig(const uint16_t* x, uint16_t* y, int64_t n, BigParams p) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    y[i] = x[i] + p.bytes[i % 8];
}
struct CopyGraph {
  const void* x;
  void* y;
  int64_t nodes;
  cudaGraphExec_t exec;
};
static CopyGraph copy_graphs[16];
static int copy_graph_count = 0;
struct HostTime {  // the handler's mean host time per `nodes`, printed at exit
  int64_t calls[4] = {}, ns[4] = {};
  ~HostTime() {
    for (int i = 0; i < 4; ++i)
      if (calls[i]) std::fprintf(stderr, "probe_graph_launched nodes=%d: %lld calls, %.3f us each\n", i,
                                 (long long)calls[i], ns[i] / 1e3 / calls[i]);
  }
};
static HostTime graph_launched_time;
struct Timed {
  int64_t nodes;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~Timed() {
    graph_launched_time.calls[nodes]++;
    graph_launched_time.ns[nodes] += std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - start).count();
  }
};
static ffi::Error GraphLaunched(cudaStream_t s, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t nodes) {
  if (nodes < 0 || nodes > 3) return ffi::Error::InvalidArgument("probe_graph_launched: nodes in 0..3");
  Timed timed{nodes};
  const uint16_t* in = static_cast<const uint16_t*>(x.untyped_data());
  auto* out = static_cast<uint16_t*>(y->untyped_data());
  for (int i = 0; i < copy_graph_count; ++i) {
    if (copy_graphs[i].x == in && copy_graphs[i].y == out && copy_graphs[i].nodes == nodes) {
      cudaError_t e = cudaGraphLaunch(copy_graphs[i].exec, s);
      return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
    }
  }
  if (copy_graph_count == 16) return ffi::Error::Internal("probe_graph_launched: more than 16 address sets");
  cudaStream_t side;
  cudaGraph_t graph;
  CopyGraph made = {in, out, nodes, nullptr};
  if (cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) != cudaSuccess ||
      cudaStreamBeginCapture(side, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
    return ffi::Error::Internal("probe_graph_launched: capture");
  int64_t n = (int64_t)x.element_count();
  if (nodes & 1) cudaMemsetAsync(out, 0, 256 < n * 2 ? 256 : n * 2, side);
  if (nodes & 2) {
    BigParams p = {};
    CopyBig<<<1, 256, 0, side>>>(in, out, n, p);
  } else {
    CopySpin<<<1, 256, 0, side>>>(in, out, n, 0);
  }
  if (cudaStreamEndCapture(side, &graph) != cudaSuccess || cudaGraphInstantiate(&made.exec, graph, 0) != cudaSuccess)
    return ffi::Error::Internal("probe_graph_launched: instantiate");
  cudaGraphDestroy(graph);
  cudaStreamDestroy(side);
  copy_graphs[copy_graph_count++] = made;
  cudaError_t e = cudaGraphLaunch(made.exec, s);
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeGraphLaunched, GraphLaunched,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
        .Attr<int64_t>("nodes"));

extern "C" XLA_FFI_TypeId* ProbeStateTypeId() { return &ProbeState::id; }
extern "C" const XLA_FFI_TypeInfo* ProbeStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<ProbeState>();
  return &info;
}
"""

LOADED_SOURCE = r"""
#include <cstdint>
extern "C" __global__ void LoadedSpin SPIN_BODY
"""

SOURCE, LOADED_SOURCE = (text.replace("SPIN_BODY", SPIN_BODY) for text in (SOURCE, LOADED_SOURCE))

CONFIGS = {"": None, "_min_graph_1": {"xla_gpu_graph_min_graph_size": 1}}
N, H = 32, 128  # the decode query: [1, 1, N, H] bf16


def _nvcc() -> str:
    found = shutil.which("nvcc") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))), None)
    if not found:
        raise RuntimeError("nvcc not found")
    return found


def _register() -> None:
    build = tempfile.mkdtemp(prefix="probe_ffi_")
    src, lib = os.path.join(build, "probe.cu"), os.path.join(build, "probe.so")
    with open(src, "w") as f:
        f.write(SOURCE)
    cmd = [_nvcc(), "-O2", "-w", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-arch=sm_90",
           f"-I{jax.ffi.include_dir()}", src, "-o", lib]  # fmt: skip
    subprocess.run(cmd, check=True)
    loaded_src, cubin = os.path.join(build, "loaded.cu"), os.path.join(build, "loaded.cubin")
    with open(loaded_src, "w") as f:
        f.write(LOADED_SOURCE)
    subprocess.run([_nvcc(), "-O2", "-cubin", "-arch=sm_90", loaded_src, "-o", cubin], check=True)
    so = ctypes.cdll.LoadLibrary(lib)
    jax.devices()  # the primary context, which the cubin is loaded into
    with open(cubin, "rb") as f:
        image = ctypes.create_string_buffer(f.read())
    if (code := so.ProbeLoadCubin(image)) != 0:
        raise RuntimeError(f"loading the cubin failed at step {code}")
    capsule = lambda name: jax.ffi.pycapsule(getattr(so, name))  # noqa: E731
    traits = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
    so.ProbeStateTypeId.restype = ctypes.c_void_p
    so.ProbeStateTypeInfo.restype = ctypes.c_void_p
    as_capsule = ctypes.pythonapi.PyCapsule_New
    as_capsule.restype, as_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    jax.ffi.register_ffi_type(
        "probe_state", {"type_id": as_capsule(so.ProbeStateTypeId(), None, None),
                        "type_info": as_capsule(so.ProbeStateTypeInfo(), None, None)}, platform="CUDA")  # fmt: skip
    jax.ffi.register_ffi_target("probe_plain", capsule("ProbePlain"), platform="CUDA", traits=traits)
    jax.ffi.register_ffi_target("probe_many", capsule("ProbeMany"), platform="CUDA", traits=traits)
    jax.ffi.register_ffi_target("probe_cudnn_shaped", capsule("ProbeCudnnShaped"), platform="CUDA", traits=traits)
    jax.ffi.register_ffi_target("probe_loaded", capsule("ProbeLoaded"), platform="CUDA", traits=traits)
    jax.ffi.register_ffi_target("probe_graph_launched", capsule("ProbeGraphLaunched"), platform="CUDA")
    jax.ffi.register_ffi_target(
        "probe_stateful", {"instantiate": capsule("ProbeInstantiate"), "initialize": capsule("ProbeInitialize"),
                           "execute": capsule("ProbeStateful")}, platform="CUDA", traits=traits)  # fmt: skip


def _ffi(x, spin_ns: int, stateful: bool = False, blob_bytes: int = 1):
    target = "probe_stateful" if stateful else "probe_plain"
    blob = np.zeros(blob_bytes, np.uint8)
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, spin_ns=np.int64(spin_ns), blob=blob)


def _ffi_many(x, spin_ns: int, operands=(), workspace_bytes: int = 0):
    """The copy (+ spin) with more operands (read by nothing) and a second, workspace-like result (never written)."""
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    if workspace_bytes:
        results.append(jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8))
    return jax.ffi.ffi_call("probe_many", results)(x, *operands, spin_ns=np.int64(spin_ns))[0]


def _ffi_named(target: str, x, spin_ns: int, **attrs):
    attrs = {k: v if isinstance(v, bool) else np.int64(v) for k, v in attrs.items()}
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, spin_ns=np.int64(spin_ns), **attrs)


def layer_fns(heavy_ns: int) -> dict:
    """name -> layer(x, cache); `cache` (a decode layer's K and V) is a jit argument of the step, as attnlib's."""
    light = lambda x: x * 0.5 + 1.0  # noqa: E731
    return {
        "xla_light": lambda x, cache: light(x),
        "ffi_copy_light": lambda x, cache: _ffi(light(x), 0),
        "ffi_spin": lambda x, cache: _ffi(light(x), heavy_ns),
        "ffi_state_spin": lambda x, cache: _ffi(light(x), heavy_ns, stateful=True),
        "ffi_blob_spin": lambda x, cache: _ffi(light(x), heavy_ns, blob_bytes=128 * 1024),
        "ffi_blob1m_spin": lambda x, cache: _ffi(light(x), heavy_ns, blob_bytes=1024 * 1024),
        "ffi_blob_light": lambda x, cache: _ffi(light(x), 0, blob_bytes=128 * 1024),
        "ffi_blob1m_light": lambda x, cache: _ffi(light(x), 0, blob_bytes=1024 * 1024),
        "ffi_many_spin": lambda x, cache: _ffi_many(light(x), heavy_ns),
        "ffi_cache_spin": lambda x, cache: _ffi_many(light(x), heavy_ns, operands=cache),
        "ffi_workspace_spin": lambda x, cache: _ffi_many(light(x), heavy_ns, workspace_bytes=1 << 20),
        "ffi_cache_workspace_spin": lambda x, cache: _ffi_many(light(x), heavy_ns, operands=cache,
                                                               workspace_bytes=1 << 20),
        "ffi_cudnn_shaped_spin": lambda x, cache: _ffi_named("probe_cudnn_shaped", light(x), heavy_ns,
                                                             cluster=False, pdl=False),
        "ffi_cluster_spin": lambda x, cache: _ffi_named("probe_cudnn_shaped", light(x), heavy_ns,
                                                        cluster=True, pdl=False),
        "ffi_pdl_spin": lambda x, cache: _ffi_named("probe_cudnn_shaped", light(x), heavy_ns,
                                                    cluster=False, pdl=True),
        "ffi_cluster_pdl_spin": lambda x, cache: _ffi_named("probe_cudnn_shaped", light(x), heavy_ns,
                                                            cluster=True, pdl=True),
        "ffi_module_spin": lambda x, cache: _ffi_named("probe_loaded", light(x), heavy_ns, which=0),
        "ffi_library_spin": lambda x, cache: _ffi_named("probe_loaded", light(x), heavy_ns, which=1),
    }  # fmt: skip


def decode_step(layer, layers: int, options):
    def step(x, cache):
        def body(h, _):
            y = layer(h.astype(jnp.bfloat16), cache).astype(jnp.float32)
            return jnp.tanh(y), None

        return jax.lax.scan(body, x.astype(jnp.float32), None, length=layers)[0]

    return jax.jit(step, compiler_options=options)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heavy-us", type=float, default=30.0)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    _register()
    x = jax.random.normal(jax.random.key(0), (1, 1, N, H), jnp.bfloat16)
    # A decode layer's KV cache (b1 · 32k, 8 heads of 128, bf16: 64 MB each).
    cache = tuple(jnp.full((1, 32768, 8, H), i, jnp.bfloat16) for i in (1, 2))
    fns = layer_fns(int(args.heavy_us * 1e3))
    names = [name for name in fns if args.only is None or name in args.only]
    for name, _ in [(name, r) for r in range(args.repeat) for name in names]:
        layer = fns[name]
        for suffix, options in CONFIGS.items():
            step = decode_step(layer, args.layers, options).lower(x, cache).compile()
            ms = min(best_per_call(step, (x, cache), loop=10, reps=5) for _ in range(3)) * 1e3
            p = pipelined_profile(step, (x, cache), calls=20, host_top=40)
            launch = [e for e in p["host"] if e["name"].startswith("cuGraphLaunch")]
            launches = sum(e["count"] for e in launch)
            launch_us = sum(e["us"] for e in launch)
            per = f"{launch_us / launches:.1f} µs x{launches:.0f}" if launches else "none"
            print(f"{name}{suffix or '_default'}: step {ms:.3f} ms; device busy {p['busy_us']:.1f} idle "
                  f"{p['idle_us']:.1f} µs/step; cuGraphLaunch {per} per step", flush=True)  # fmt: skip
            for e in p["host"][:14]:
                print(f"    host {e['us']:8.1f} us x{e['count']:<6.3g} {e['name']}", flush=True)
            for g in p["gaps"][:4]:
                print(f"    gap  {g['us']:8.1f} us x{g['count']:<6.3g} {g['after']} -> {g['before']}", flush=True)


if __name__ == "__main__":
    main()
