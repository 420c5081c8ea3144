// Issues the launches a stream capture recorded (kernels and memsets) again, as attnlib's own driver calls.
//
// A CUDA graph that holds the nodes cuDNN's launches leave in a stream capture makes `cuGraphLaunch` wait for the
// device once a few dozen launches of it are in flight, and each launch costs about 2 us more than the launch of a
// graph holding the same kernels with the same parameters launched by us, captured the same way (measured on an
// H200, docs/performance.md "How attnlib's choices were measured"). attnlib therefore captures cuDNN's work on a
// private stream, reads the kernels and memsets out of that graph, and issues them itself: into the capture that
// becomes a replay graph, or into XLA's command-buffer capture.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <vector>

namespace attnlib {

class Relaunch {
 public:
  // Reads `graph` (a stream capture): its kernel and memset nodes, in an order that respects every edge. Returns
  // false when the graph holds any other kind of node, an edge that is not a full dependency (a programmatic
  // launch), a 2-D memset, or a kernel launched with attributes; or when the driver lacks an entry point used here.
  // The kernels' parameters are read from the graph's nodes when issued: `graph` must outlive every `Issue`.
  bool Read(cudaGraph_t graph);

  // Enqueues the launches, in order, on `stream`. Returns the first failing driver call's result.
  CUresult Issue(cudaStream_t stream) const;

 private:
  struct Step {
    bool kernel = false;
    CUDA_KERNEL_NODE_PARAMS_v2 launch{};  // a kernel: function, grid, block, shared memory, parameters
    CUfunction function = nullptr;
    CUDA_MEMSET_NODE_PARAMS memset{};  // a memset
  };
  std::vector<Step> steps_;
};

}  // namespace attnlib
