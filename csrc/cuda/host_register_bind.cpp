// Page-locking of our own aligned host buffers for CUDA, compiled only when a CUDA toolkit is present.
// cudaHostRegister works at the driver level with the PORTABLE flag, so memory registered here counts as
// pinned for every CUDA runtime in the process (torch's included): its async copies do not bounce.
#include <cuda_runtime_api.h>

#include <string>
#include <utility>

#include "bindings.h"

namespace offload {

namespace {
// (ok, message): failure is expected (no GPU, RLIMIT_MEMLOCK in containers) and handled by the caller.
std::pair<bool, std::string> host_register(uintptr_t ptr, size_t nbytes) {
  cudaError_t err = cudaHostRegister(reinterpret_cast<void*>(ptr), nbytes, cudaHostRegisterPortable);
  if (err == cudaSuccess) return {true, ""};
  cudaGetLastError();  // clear the sticky-free error so later calls are not confused by it
  return {false, cudaGetErrorString(err)};
}

std::pair<bool, std::string> host_unregister(uintptr_t ptr) {
  cudaError_t err = cudaHostUnregister(reinterpret_cast<void*>(ptr));
  if (err == cudaSuccess) return {true, ""};
  cudaGetLastError();
  return {false, cudaGetErrorString(err)};
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}
}  // namespace

void bind_cuda(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("cuda_host_register", &host_register, py::arg("ptr"), py::arg("nbytes"),
        py::call_guard<py::gil_scoped_release>(),
        "Page-lock [ptr, ptr+nbytes) for CUDA. Returns (ok, error message).");
  m.def("cuda_host_unregister", &host_unregister, py::arg("ptr"), py::call_guard<py::gil_scoped_release>(),
        "Undo cuda_host_register. Returns (ok, error message).");
  m.def("cuda_device_count", &device_count, "CUDA devices visible to the runtime offload was built with.");
  m.attr("cuda_runtime_version") = CUDART_VERSION;
}

}  // namespace offload
