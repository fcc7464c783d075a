// The module `offload._C`, and all of its Python glue in one translation unit: this file #includes every
// *_bind.cpp, and setup.py compiles only this one of them. pybind11's headers, and the internals every
// binding instantiates, are then compiled once rather than once per file (issue 33: 87 s of compiler time
// for the whole core in 26 files before, 39 s now, of which this file 13 s). The kernels keep their own files.
#include "bindings.h"

#include "adam/adam_bind.cpp"
#include "adam/adam_moments_bind.cpp"
#include "buffers/buffers_bind.cpp"
#include "common/cpu_features_bind.cpp"
#include "common/crc32c_bind.cpp"
#include "io/io_bind.cpp"
#ifdef OFFLOAD_WITH_CUDA
#include "cuda/host_register_bind.cpp"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "offload's native core: fused CPU Adam, aligned/pinned staging buffers and async file I/O.\n"
      "Takes pointers and sizes; offload's Python layer validates dtype, device and contiguity first.";
  offload::bind_cpu_features(m);
  offload::bind_adam(m);
  offload::bind_adam_moments(m);
  offload::bind_buffers(m);
  offload::bind_io(m);
  offload::bind_crc32c(m);
#ifdef OFFLOAD_WITH_CUDA
  m.attr("built_with_cuda") = true;
  offload::bind_cuda(m);
#else
  m.attr("built_with_cuda") = false;
#endif
}
