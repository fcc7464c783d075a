// Python view of the staging arena: leases export the buffer protocol, so `torch.frombuffer(lease)` sees
// the memory without a copy and keeps the lease alive for as long as any tensor uses it.
#include <memory>

#include "bindings.h"
#include "buffers/host_arena.h"

namespace offload {

namespace {
// A leased range; returns itself to the arena when the last Python reference (including every tensor
// made from it with torch.frombuffer) is gone.
struct Lease {
  std::shared_ptr<HostArena> arena;
  size_t offset;
  size_t nbytes;
  ~Lease() { arena->release(offset); }
  uintptr_t ptr() const { return reinterpret_cast<uintptr_t>(arena->base() + offset); }
  // The whole range the lease owns (at least one page), so even a 0-byte lease has a valid buffer.
  size_t exported_bytes() const { return HostArena::round_up(nbytes == 0 ? 1 : nbytes); }
};
}  // namespace

void bind_buffers(pybind11::module_& m) {
  namespace py = pybind11;
  py::register_exception<ArenaExhausted>(m, "ArenaExhausted", PyExc_MemoryError);

  py::class_<Lease>(m, "Lease", py::buffer_protocol(), "A 4 KiB-aligned range leased from a HostArena.")
      .def_property_readonly("ptr", &Lease::ptr, "Address of the first byte (a multiple of 4096).")
      .def_readonly("nbytes", &Lease::nbytes, "Bytes requested (the range may be rounded up to 4 KiB).")
      .def_readonly("offset", &Lease::offset, "Offset of the range from the arena's base.")
      .def_buffer([](Lease& l) {
        return py::buffer_info(reinterpret_cast<void*>(l.ptr()), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(l.exported_bytes())}, {1}, /*readonly=*/false);
      });

  py::class_<HostArena, std::shared_ptr<HostArena>>(
      m, "HostArena", "A fixed budget of page-aligned host memory, leased out in 4 KiB-aligned ranges.")
      .def(py::init<size_t>(), py::arg("capacity"))
      .def_property_readonly("base_ptr", [](const HostArena& a) { return reinterpret_cast<uintptr_t>(a.base()); })
      .def_property_readonly("capacity", &HostArena::capacity)
      .def(
          "lease",
          [](const std::shared_ptr<HostArena>& arena, size_t nbytes, bool wait, double timeout) {
            size_t offset;
            {
              py::gil_scoped_release release;  // waiting must not block the threads that would free memory
              offset = arena->allocate(nbytes, wait, timeout);
            }
            return std::unique_ptr<Lease>(new Lease{arena, offset, nbytes});
          },
          py::arg("nbytes"), py::arg("wait") = false, py::arg("timeout") = -1.0,
          "Lease nbytes; raises ArenaExhausted when nothing fits (or after `timeout` s when wait=True).")
      .def("stats", [](const HostArena& a) {
        ArenaStats s = a.stats();
        py::dict d;
        d["capacity"] = s.capacity;
        d["in_use"] = s.in_use;
        d["peak_in_use"] = s.peak_in_use;
        d["largest_free"] = s.largest_free;
        d["live_leases"] = s.live_leases;
        d["total_leases"] = s.total_leases;
        return d;
      });
}

}  // namespace offload
