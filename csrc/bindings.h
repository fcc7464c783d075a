// Each part of the native core registers its own Python bindings in a *_bind.cpp; bindings.cpp #includes
// them all (one translation unit) and calls these.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>

namespace offload {
void bind_cpu_features(pybind11::module_& m);  // common/cpu_features_bind.cpp
void bind_adam(pybind11::module_& m);          // adam/adam_bind.cpp
void bind_adam_moments(pybind11::module_& m);  // adam/adam_moments_bind.cpp
void bind_buffers(pybind11::module_& m);       // buffers/buffers_bind.cpp
void bind_io(pybind11::module_& m);            // io/io_bind.cpp
void bind_crc32c(pybind11::module_& m);        // common/crc32c_bind.cpp
#ifdef OFFLOAD_WITH_CUDA
void bind_cuda(pybind11::module_& m);          // cuda/host_register_bind.cpp
#endif

// A Python int holding an address, as the pointer the kernels take.
template <typename T>
T* address(uintptr_t ptr) {
  return reinterpret_cast<T*>(ptr);
}
}  // namespace offload
