// The captured-launch reader and re-issuer of relaunch.h.

#include "relaunch.h"

#include <dlfcn.h>

#include <cstring>
#include <type_traits>
#include <unordered_map>
#include <utility>

namespace attnlib {
namespace {

// An edge's data (CUgraphEdgeData, CUDA 12.3+), declared here so the module builds against older headers too.
struct EdgeData {
  unsigned char from_port, to_port, type, reserved[5];
};
static_assert(sizeof(EdgeData) == 8, "CUgraphEdgeData is 8 bytes");

// The driver entry points used here, from the libcuda the process already loaded (JAX's CUDA plugin loads it).
struct Driver {
  CUresult (*graph_get_nodes)(CUgraph, CUgraphNode*, size_t*);
  CUresult (*graph_get_edges_v2)(CUgraph, CUgraphNode*, CUgraphNode*, EdgeData*, size_t*);  // null before 12.3
  CUresult (*graph_get_edges)(CUgraph, CUgraphNode*, CUgraphNode*, size_t*);
  CUresult (*node_get_type)(CUgraphNode, CUgraphNodeType*);
  CUresult (*kernel_node_get_params)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS_v2*);
  CUresult (*kernel_node_get_attribute)(CUgraphNode, CUkernelNodeAttrID, CUkernelNodeAttrValue*);
  CUresult (*kernel_get_function)(CUfunction*, CUkernel);
  CUresult (*memset_node_get_params)(CUgraphNode, CUDA_MEMSET_NODE_PARAMS*);
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                            void**, void**);
  CUresult (*memset_d8)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*memset_d16)(CUdeviceptr, unsigned short, size_t, CUstream);
  CUresult (*memset_d32)(CUdeviceptr, unsigned int, size_t, CUstream);
};

const Driver* GetDriver() {
  static const Driver* driver = []() -> const Driver* {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) return nullptr;
    static Driver d;
    auto load = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      return fn != nullptr;
    };
    load(d.graph_get_edges_v2, "cuGraphGetEdges_v2");
    load(d.graph_get_edges, "cuGraphGetEdges");
    bool ok = load(d.graph_get_nodes, "cuGraphGetNodes") && load(d.node_get_type, "cuGraphNodeGetType") &&
              load(d.kernel_node_get_params, "cuGraphKernelNodeGetParams_v2") &&
              load(d.kernel_node_get_attribute, "cuGraphKernelNodeGetAttribute") &&
              load(d.kernel_get_function, "cuKernelGetFunction") &&
              load(d.memset_node_get_params, "cuGraphMemsetNodeGetParams") &&
              load(d.launch_kernel, "cuLaunchKernel") && load(d.memset_d8, "cuMemsetD8Async") &&
              load(d.memset_d16, "cuMemsetD16Async") && load(d.memset_d32, "cuMemsetD32Async") &&
              (d.graph_get_edges_v2 != nullptr || d.graph_get_edges != nullptr);
    return ok ? &d : nullptr;
  }();
  return driver;
}

// Whether a kernel node was launched without attributes: not cooperative, no cluster, default priority, memory
// synchronisation domain and L2 access policy (what a plain cuLaunchKernel gives).
bool PlainLaunch(const Driver& d, CUgraphNode node) {
  CUkernelNodeAttrValue v;
  auto read = [&](CUkernelNodeAttrID id) {  // the attribute into `v`; false where the driver cannot read it
    std::memset(&v, 0, sizeof(v));
    return d.kernel_node_get_attribute(node, id, &v) == CUDA_SUCCESS;
  };
  return read(CU_LAUNCH_ATTRIBUTE_COOPERATIVE) && v.cooperative == 0 &&
         read(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) && v.clusterDim.x <= 1 && v.clusterDim.y <= 1 &&
         v.clusterDim.z <= 1 && read(CU_LAUNCH_ATTRIBUTE_PRIORITY) && v.priority == 0 &&
         read(CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN) && v.memSyncDomain == CU_LAUNCH_MEM_SYNC_DOMAIN_DEFAULT &&
         read(CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW) && v.accessPolicyWindow.num_bytes == 0;
}

}  // namespace

bool Relaunch::Read(cudaGraph_t graph) {
  steps_.clear();
  const Driver* d = GetDriver();
  if (d == nullptr) return false;
  size_t n = 0;
  if (d->graph_get_nodes(graph, nullptr, &n) != CUDA_SUCCESS) return false;
  std::vector<CUgraphNode> nodes(n);
  if (n > 0 && d->graph_get_nodes(graph, nodes.data(), &n) != CUDA_SUCCESS) return false;

  size_t n_edges = 0;
  std::vector<CUgraphNode> from, to;
  if (d->graph_get_edges_v2 != nullptr) {
    if (d->graph_get_edges_v2(graph, nullptr, nullptr, nullptr, &n_edges) != CUDA_SUCCESS) return false;
    from.resize(n_edges);
    to.resize(n_edges);
    std::vector<EdgeData> data(n_edges);
    if (n_edges > 0 &&
        d->graph_get_edges_v2(graph, from.data(), to.data(), data.data(), &n_edges) != CUDA_SUCCESS) {
      return false;
    }
    for (const EdgeData& e : data) {
      if (e.from_port != 0 || e.to_port != 0 || e.type != 0) return false;  // not a full dependency
    }
  } else {
    // The first API fails (CUDA_ERROR_LOSSY_QUERY) on an edge that carries data.
    if (d->graph_get_edges(graph, nullptr, nullptr, &n_edges) != CUDA_SUCCESS) return false;
    from.resize(n_edges);
    to.resize(n_edges);
    if (n_edges > 0 && d->graph_get_edges(graph, from.data(), to.data(), &n_edges) != CUDA_SUCCESS) return false;
  }

  // Kahn's order: a node once every node it depends on is placed (one stream then honours every edge).
  std::unordered_map<CUgraphNode, size_t> index;
  for (size_t i = 0; i < n; ++i) index[nodes[i]] = i;
  std::vector<int> waiting(n, 0);
  std::vector<std::vector<size_t>> after(n);
  for (size_t e = 0; e < n_edges; ++e) {
    auto f = index.find(from[e]);
    auto t = index.find(to[e]);
    if (f == index.end() || t == index.end()) return false;
    after[f->second].push_back(t->second);
    ++waiting[t->second];
  }
  std::vector<size_t> order;
  for (size_t i = 0; i < n; ++i) {
    if (waiting[i] == 0) order.push_back(i);
  }
  for (size_t k = 0; k < order.size(); ++k) {
    for (size_t next : after[order[k]]) {
      if (--waiting[next] == 0) order.push_back(next);
    }
  }
  if (order.size() != n) return false;

  std::vector<Step> steps;
  steps.reserve(n);
  for (size_t i : order) {
    CUgraphNodeType type;
    if (d->node_get_type(nodes[i], &type) != CUDA_SUCCESS) return false;
    Step step;
    if (type == CU_GRAPH_NODE_TYPE_KERNEL) {
      step.kernel = true;
      if (d->kernel_node_get_params(nodes[i], &step.launch) != CUDA_SUCCESS) return false;
      step.function = step.launch.func;
      if (step.function == nullptr &&
          (step.launch.kern == nullptr || d->kernel_get_function(&step.function, step.launch.kern) != CUDA_SUCCESS)) {
        return false;
      }
      if (!PlainLaunch(*d, nodes[i])) return false;
    } else if (type == CU_GRAPH_NODE_TYPE_MEMSET) {
      if (d->memset_node_get_params(nodes[i], &step.memset) != CUDA_SUCCESS) return false;
      const unsigned size = step.memset.elementSize;
      if (step.memset.height > 1 || (size != 1 && size != 2 && size != 4)) return false;
    } else {
      return false;
    }
    steps.push_back(step);
  }
  steps_ = std::move(steps);
  return true;
}

CUresult Relaunch::Issue(cudaStream_t stream) const {
  const Driver* d = GetDriver();
  if (d == nullptr) return CUDA_ERROR_NOT_FOUND;
  for (const Step& s : steps_) {
    CUresult r;
    if (s.kernel) {
      const CUDA_KERNEL_NODE_PARAMS_v2& k = s.launch;
      r = d->launch_kernel(s.function, k.gridDimX, k.gridDimY, k.gridDimZ, k.blockDimX, k.blockDimY, k.blockDimZ,
                           k.sharedMemBytes, stream, k.kernelParams, k.extra);
    } else {
      const CUDA_MEMSET_NODE_PARAMS& m = s.memset;
      if (m.elementSize == 1) {
        r = d->memset_d8(m.dst, static_cast<unsigned char>(m.value), m.width, stream);
      } else if (m.elementSize == 2) {
        r = d->memset_d16(m.dst, static_cast<unsigned short>(m.value), m.width, stream);
      } else {
        r = d->memset_d32(m.dst, m.value, m.width, stream);
      }
    }
    if (r != CUDA_SUCCESS) return r;
  }
  return CUDA_SUCCESS;
}

}  // namespace attnlib
