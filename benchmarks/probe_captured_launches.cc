// Probe (not part of attnlib): describes a CUDA graph captured from cuDNN's launches and times its launches against
// graphs holding the same kernels and memsets made other ways. Built into the native extension only for the probe;
// see benchmarks/probe_captured_launches.py for how to build and run it.
#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <vector>

#define PROBE_STR(x) #x
#define PROBE_XSTR(x) PROBE_STR(x)

namespace attnlib {
namespace {

void* Lib() {
  static void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  return lib;
}

template <typename F>
F Sym(const char* name) {
  void* p = dlsym(Lib(), name);
  if (p == nullptr) std::fprintf(stderr, "[gp] missing symbol %s\n", name);
  return reinterpret_cast<F>(p);
}

#define S(f) static auto p_##f = Sym<decltype(&f)>(PROBE_XSTR(f))

double Now() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

void ProbeCapturedLaunches(CUgraph graph, CUgraphExec exec, const char* label) {
  S(cuGraphGetNodes);
  S(cuGraphNodeGetType);
  S(cuGraphKernelNodeGetParams);
  S(cuGraphKernelNodeGetAttribute);
  S(cuGraphKernelNodeSetAttribute);
  S(cuFuncGetName);
  S(cuFuncGetParamInfo);
  S(cuFuncGetAttribute);
  S(cuKernelGetFunction);
  S(cuGraphMemsetNodeGetParams);
  S(cuGraphGetEdges);
  S(cuGraphCreate);
  S(cuGraphAddKernelNode);
  S(cuGraphAddMemsetNode);
  S(cuGraphInstantiate);
  S(cuGraphLaunch);
  S(cuGraphExecDestroy);
  S(cuGraphDestroy);
  S(cuStreamCreate);
  S(cuStreamSynchronize);
  S(cuCtxSynchronize);
  S(cuCtxGetCurrent);
  S(cuLaunchKernel);
  S(cuMemsetD8Async);
  S(cuMemsetD32Async);

  p_cuCtxSynchronize();
  CUcontext ctx = nullptr;
  p_cuCtxGetCurrent(&ctx);
  size_t n = 0;
  p_cuGraphGetNodes(graph, nullptr, &n);
  std::vector<CUgraphNode> nodes(n);
  p_cuGraphGetNodes(graph, nodes.data(), &n);
  size_t ne = 0;
  p_cuGraphGetEdges(graph, nullptr, nullptr, nullptr, &ne);
  std::vector<CUgraphNode> from(ne), to(ne);
  std::vector<CUgraphEdgeData> edata(ne);
  p_cuGraphGetEdges(graph, from.data(), to.data(), edata.data(), &ne);
  std::fprintf(stderr, "[gp] === %s: %zu nodes, %zu edges\n", label, n, ne);
  std::map<CUgraphNode, int> index;
  for (size_t i = 0; i < n; ++i) index[nodes[i]] = static_cast<int>(i);
  for (size_t e = 0; e < ne; ++e) {
    std::fprintf(stderr, "[gp] edge %d -> %d from_port %d to_port %d type %d\n", index[from[e]], index[to[e]],
                 edata[e].from_port, edata[e].to_port, edata[e].type);
  }
  struct KernelInfo {
    CUDA_KERNEL_NODE_PARAMS params;
    CUfunction func;
  };
  std::vector<CUgraphNodeType> types(n);
  std::vector<KernelInfo> kernels(n);
  std::vector<CUDA_MEMSET_NODE_PARAMS> memsets(n);
  for (size_t i = 0; i < n; ++i) {
    p_cuGraphNodeGetType(nodes[i], &types[i]);
    if (types[i] == CU_GRAPH_NODE_TYPE_KERNEL) {
      KernelInfo& k = kernels[i];
      std::memset(&k.params, 0, sizeof(k.params));
      CUresult r = p_cuGraphKernelNodeGetParams(nodes[i], &k.params);
      k.func = k.params.func;
      if (k.func == nullptr && k.params.kern != nullptr) p_cuKernelGetFunction(&k.func, k.params.kern);
      const char* name = "?";
      if (k.func != nullptr) p_cuFuncGetName(&name, k.func);
      size_t count = 0, total = 0, off = 0, sz = 0;
      while (k.func != nullptr && p_cuFuncGetParamInfo(k.func, count, &off, &sz) == CUDA_SUCCESS) {
        total = off + sz;
        ++count;
      }
      std::fprintf(stderr,
                   "[gp] node %zu KERNEL (get %d) %s grid {%u,%u,%u} block {%u,%u,%u} smem %u params %zu (%zu bytes) "
                   "extra %p kern %p func %p ctx %p\n",
                   i, r, name, k.params.gridDimX, k.params.gridDimY, k.params.gridDimZ, k.params.blockDimX,
                   k.params.blockDimY, k.params.blockDimZ, k.params.sharedMemBytes, count, total,
                   static_cast<void*>(k.params.extra), static_cast<void*>(k.params.kern),
                   static_cast<void*>(k.params.func), static_cast<void*>(k.params.ctx));
      std::fprintf(stderr, "[gp]   func attrs:");
      for (int a = 0; a <= 15; ++a) {
        int v = -1;
        if (k.func != nullptr) p_cuFuncGetAttribute(&v, static_cast<CUfunction_attribute>(a), k.func);
        std::fprintf(stderr, " %d=%d", a, v);
      }
      std::fprintf(stderr, "\n[gp]   node attrs:");
      for (int a = 1; a <= 16; ++a) {
        CUkernelNodeAttrValue v;
        std::memset(&v, 0, sizeof(v));
        CUresult ar = p_cuGraphKernelNodeGetAttribute(nodes[i], static_cast<CUkernelNodeAttrID>(a), &v);
        unsigned w[4];
        std::memcpy(w, &v, sizeof(w));
        if (ar == CUDA_SUCCESS) {
          std::fprintf(stderr, " %d=[%u %u %u %u]", a, w[0], w[1], w[2], w[3]);
        } else {
          std::fprintf(stderr, " %d=err%d", a, ar);
        }
      }
      std::fprintf(stderr, "\n");
    } else if (types[i] == CU_GRAPH_NODE_TYPE_MEMSET) {
      CUDA_MEMSET_NODE_PARAMS& m = memsets[i];
      p_cuGraphMemsetNodeGetParams(nodes[i], &m);
      std::fprintf(stderr, "[gp] node %zu MEMSET dst %p pitch %zu value %u elementSize %u width %zu height %zu\n", i,
                   reinterpret_cast<void*>(m.dst), m.pitch, m.value, m.elementSize, m.width, m.height);
    } else {
      std::fprintf(stderr, "[gp] node %zu type %d\n", i, static_cast<int>(types[i]));
    }
  }

  CUstream s = nullptr;
  p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  auto time = [&](const char* what, const std::function<void()>& once) {
    for (int w = 0; w < 5; ++w) once();
    p_cuStreamSynchronize(s);
    for (int reps : {100, 30}) {
      std::vector<double> each(reps);
      double t0 = Now();
      for (int r = 0; r < reps; ++r) {
        double a = Now();
        once();
        each[r] = Now() - a;
      }
      double t1 = Now();
      p_cuStreamSynchronize(s);
      double t2 = Now();
      int slow = static_cast<int>(std::count_if(each.begin(), each.end(), [](double v) { return v > 20.0; }));
      std::vector<double> sorted = each;
      std::sort(sorted.begin(), sorted.end());
      std::fprintf(stderr,
                   "[gp] %-34s x%3d launch us: median %7.2f p90 %7.2f max %7.2f first5 %.1f %.1f %.1f %.1f %.1f | "
                   "host %.2f/launch, wall %.2f/launch, >20us %d\n",
                   what, reps, sorted[reps / 2], sorted[reps * 9 / 10], sorted.back(), each[0], each[1], each[2],
                   each[3], each[4], (t1 - t0) / reps, (t2 - t0) / reps, slow);
    }
  };
  auto rebuild = [&](bool copy_attrs) -> CUgraphExec {
    CUgraph g = nullptr;
    p_cuGraphCreate(&g, 0);
    std::map<CUgraphNode, CUgraphNode> made;
    // Captured graphs are chains: add in edge order (a node once all its sources are made).
    std::vector<bool> done(n, false);
    for (size_t pass = 0; pass < n; ++pass) {
      for (size_t i = 0; i < n; ++i) {
        if (done[i]) continue;
        bool ready = true;
        std::vector<CUgraphNode> deps;
        for (size_t e = 0; e < ne; ++e) {
          if (to[e] != nodes[i]) continue;
          if (!done[index[from[e]]]) ready = false;
          else if (made.count(from[e])) deps.push_back(made[from[e]]);
        }
        if (!ready) continue;
        done[i] = true;
        CUgraphNode node = nullptr;
        CUresult r;
        if (types[i] == CU_GRAPH_NODE_TYPE_KERNEL) {
          r = p_cuGraphAddKernelNode(&node, g, deps.data(), deps.size(), &kernels[i].params);
          if (r == CUDA_SUCCESS && copy_attrs) {
            for (int a : {1, 2, 4, 5, 8, 9, 10, 11, 13}) {
              CUkernelNodeAttrValue v;
              std::memset(&v, 0, sizeof(v));
              if (p_cuGraphKernelNodeGetAttribute(nodes[i], static_cast<CUkernelNodeAttrID>(a), &v) == CUDA_SUCCESS) {
                CUresult sr = p_cuGraphKernelNodeSetAttribute(node, static_cast<CUkernelNodeAttrID>(a), &v);
                if (sr != CUDA_SUCCESS) std::fprintf(stderr, "[gp] set attr %d: %d\n", a, sr);
              }
            }
          }
        } else {
          r = p_cuGraphAddMemsetNode(&node, g, deps.data(), deps.size(), &memsets[i], ctx);
        }
        if (r != CUDA_SUCCESS) std::fprintf(stderr, "[gp] add node %zu: %d\n", i, r);
        made[nodes[i]] = node;
      }
    }
    CUgraphExec e = nullptr;
    CUresult r = p_cuGraphInstantiate(&e, g, 0);
    if (r != CUDA_SUCCESS) std::fprintf(stderr, "[gp] instantiate: %d\n", r);
    p_cuGraphDestroy(g);
    return e;
  };

  S(cuGraphClone);
  S(cuGraphAddChildGraphNode);
  S(cuStreamBeginCapture);
  S(cuStreamEndCapture);
  auto instantiate = [&](CUgraph g) -> CUgraphExec {
    CUgraphExec e = nullptr;
    CUresult r = p_cuGraphInstantiate(&e, g, 0);
    if (r != CUDA_SUCCESS) std::fprintf(stderr, "[gp] instantiate: %d\n", r);
    return e;
  };
  // Our own launches of the nodes, in the graph's node order (its edge order in every graph measured).
  auto direct = [&](CUstream on) {
    for (size_t i = 0; i < n; ++i) {
      if (types[i] == CU_GRAPH_NODE_TYPE_KERNEL) {
        const CUDA_KERNEL_NODE_PARAMS& k = kernels[i].params;
        CUresult r = p_cuLaunchKernel(kernels[i].func, k.gridDimX, k.gridDimY, k.gridDimZ, k.blockDimX, k.blockDimY,
                                      k.blockDimZ, k.sharedMemBytes, on, k.kernelParams, k.extra);
        if (r != CUDA_SUCCESS) std::fprintf(stderr, "[gp] launch %zu: %d\n", i, r);
      } else if (types[i] == CU_GRAPH_NODE_TYPE_MEMSET) {
        const CUDA_MEMSET_NODE_PARAMS& m = memsets[i];
        if (m.elementSize == 1) p_cuMemsetD8Async(m.dst, static_cast<unsigned char>(m.value), m.width, on);
        else p_cuMemsetD32Async(m.dst, m.value, m.width, on);
      }
    }
  };
  std::vector<CUgraphExec> execs;
  auto timed_exec = [&](const char* what, CUgraphExec e) {
    if (e == nullptr) return;
    execs.push_back(e);
    time(what, [&] { p_cuGraphLaunch(e, s); });
  };
  if (exec != nullptr) time("V1 captured exec (runtime inst.)", [&] { p_cuGraphLaunch(exec, s); });
  timed_exec("V2 rebuilt, no attrs", rebuild(false));
  timed_exec("V3 rebuilt, attrs copied", rebuild(true));
  timed_exec("V4 captured, driver inst.", instantiate(graph));
  {
    CUgraph c = nullptr;
    p_cuGraphClone(&c, graph);
    timed_exec("V5 clone of captured", instantiate(c));
    p_cuGraphDestroy(c);
  }
  {
    CUstream cs = nullptr;
    p_cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING);
    CUgraph c = nullptr;
    p_cuStreamBeginCapture(cs, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    direct(cs);
    CUresult r = p_cuStreamEndCapture(cs, &c);
    if (r != CUDA_SUCCESS) std::fprintf(stderr, "[gp] recapture: %d\n", r);
    if (c) {
      timed_exec("V6 our launches captured", instantiate(c));
      p_cuGraphDestroy(c);
    }
  }
  for (int which = 0; which < 2; ++which) {
    CUgraph child = nullptr;
    if (which == 0) {
      // The rebuilt graph (a chain in edge order), as a graph rather than an exec.
      CUgraph g = nullptr;
      p_cuGraphCreate(&g, 0);
      CUgraphNode prev = nullptr;
      std::vector<size_t> order;
      std::vector<bool> used(n, false);
      for (size_t pass = 0; pass < n; ++pass)
        for (size_t i = 0; i < n; ++i) {
          if (used[i]) continue;
          bool ready = true;
          for (size_t e = 0; e < ne; ++e)
            if (to[e] == nodes[i] && !used[index[from[e]]]) ready = false;
          if (ready) { used[i] = true; order.push_back(i); }
        }
      for (size_t i : order) {
        CUgraphNode node = nullptr;
        if (types[i] == CU_GRAPH_NODE_TYPE_KERNEL)
          p_cuGraphAddKernelNode(&node, g, prev ? &prev : nullptr, prev ? 1 : 0, &kernels[i].params);
        else
          p_cuGraphAddMemsetNode(&node, g, prev ? &prev : nullptr, prev ? 1 : 0, &memsets[i], ctx);
        prev = node;
      }
      child = g;
    } else {
      child = graph;
    }
    CUgraph parent = nullptr;
    p_cuGraphCreate(&parent, 0);
    CUgraphNode node = nullptr;
    CUresult r = p_cuGraphAddChildGraphNode(&node, parent, nullptr, 0, child);
    if (r != CUDA_SUCCESS) std::fprintf(stderr, "[gp] child: %d\n", r);
    timed_exec(which == 0 ? "V7 rebuilt as child node" : "V8 captured as child node", instantiate(parent));
    p_cuGraphDestroy(parent);
    if (which == 0) p_cuGraphDestroy(child);
  }
  time("V9 direct launches (+memsets)", [&] { direct(s); });
  if (exec != nullptr) time("V10 captured exec again", [&] { p_cuGraphLaunch(exec, s); });
  p_cuCtxSynchronize();
  for (CUgraphExec e : execs) p_cuGraphExecDestroy(e);
  std::fprintf(stderr, "[gp] === end %s\n", label);
}

}  // namespace attnlib
