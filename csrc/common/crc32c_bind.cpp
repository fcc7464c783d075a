// Python bindings of the CRC-32C checksums: _C.crc32c, crc32c_portable, crc32c_path(s), crc32c_with and
// crc32c_combine. Arguments are raw addresses and sizes; every checksum releases the GIL.
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "common/crc32c.h"

namespace offload {

void bind_crc32c(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "crc32c",
      [](uintptr_t ptr, size_t nbytes, uint32_t seed) {
        return crc32c(reinterpret_cast<const void*>(ptr), nbytes, seed);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("seed") = 0, py::call_guard<py::gil_scoped_release>(),
      "CRC-32C of nbytes at address ptr, continuing from seed (0 starts a new checksum).");
  m.def(
      "crc32c_portable",
      [](uintptr_t ptr, size_t nbytes, uint32_t seed) {
        return crc32c_portable(reinterpret_cast<const void*>(ptr), nbytes, seed);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("seed") = 0, py::call_guard<py::gil_scoped_release>(),
      "The table path of crc32c (same values; for tests and measurements).");
  m.def("crc32c_path", [] { return std::string(crc32c_path()); },
        "The path crc32c takes on this CPU: 'vpclmulqdq-avx512', 'pclmulqdq', 'sse4.2' or 'table'.");
  m.def("crc32c_paths", &crc32c_paths, "The crc32c paths this CPU can run, preferred first (the first is crc32c_path(), the last 'table').");
  m.def(
      "crc32c_with",
      [](const std::string& path, uintptr_t ptr, size_t nbytes, uint32_t seed) {
        return crc32c_with(path, reinterpret_cast<const void*>(ptr), nbytes, seed);
      },
      py::arg("path"), py::arg("ptr"), py::arg("nbytes"), py::arg("seed") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "crc32c along one named path (tests, benchmarks); ValueError if unknown or unsupported on this CPU.");
  m.def("crc32c_combine", &crc32c_combine, py::arg("crc1"), py::arg("crc2"), py::arg("len2"),
        "The CRC-32C of A followed by B, from crc1 = crc32c(A), crc2 = crc32c(B) and len2 = len(B) in bytes.");
}

}  // namespace offload
