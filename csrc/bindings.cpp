#include "bindings.h"

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
