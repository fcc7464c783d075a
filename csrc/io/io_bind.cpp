// Python bindings of the async I/O engines: _C.IoEngine and _C.IoRequest.
// Python validates tensors, alignment and files first, passes raw addresses, and turns a request's errno
// into OffloadIOError (offload/io/). Waiting releases the GIL.
#include <pybind11/stl.h>

#include <cerrno>
#include <stdexcept>
#include <system_error>
#include <tuple>

#include "bindings.h"
#include "io/io_engine.h"

namespace py = pybind11;

namespace offload {
namespace {

using io::Chunk;
using io::Engine;
using io::Request;

// (fd, direct, address, size, file offset): one contiguous byte range of a request.
using Segment = std::tuple<int, bool, uintptr_t, size_t, uint64_t>;

class EngineHandle {
 public:
  EngineHandle(const std::string& kind, unsigned queue_depth, unsigned num_threads) {
    try {
      engine_ = io::make_engine(kind, queue_depth, num_threads);
    } catch (const std::system_error& e) {
      errno = e.code().value();
      PyErr_SetFromErrno(PyExc_OSError);
      throw py::error_already_set();
    }
  }

  std::shared_ptr<Request> submit(bool write, const std::vector<Segment>& segments, size_t chunk_bytes) {
    if (!engine_) throw std::runtime_error("this IoEngine is closed");
    if (chunk_bytes == 0) throw std::invalid_argument("chunk_bytes must be positive");
    size_t count = 0;
    for (const Segment& s : segments) count += (std::get<3>(s) + chunk_bytes - 1) / chunk_bytes;
    auto request = std::make_shared<Request>(count);
    std::vector<Chunk*> chunks;
    chunks.reserve(count);
    for (const auto& [fd, direct, address, size, offset] : segments) {
      for (size_t at = 0; at < size; at += chunk_bytes) {
        Chunk* c = new Chunk;
        c->request = request;
        c->op = write ? io::Op::kWrite : io::Op::kRead;
        c->fd = fd;
        c->direct = direct;
        c->buf = reinterpret_cast<char*>(address) + at;
        c->len = std::min(chunk_bytes, size - at);
        c->offset = offset + at;
        chunks.push_back(c);
      }
    }
    engine_->submit(chunks);
    return request;
  }

  void close() { engine_.reset(); }  // drains in-flight chunks
  std::string name() const { return engine_ ? engine_->name() : "closed"; }

 private:
  std::unique_ptr<Engine> engine_;
};

}  // namespace

void bind_io(py::module_& m) {
  py::class_<Request, std::shared_ptr<Request>>(m, "IoRequest",
                                                "Completion state of one submitted read or write.")
      .def("done", &Request::done, "Whether every chunk has finished (successfully or not).")
      .def(
          "wait",
          [](const Request& r, double timeout_s) {
            py::gil_scoped_release release;
            return r.wait(timeout_s);
          },
          py::arg("timeout_s") = -1.0, "Block (GIL released) until done or timeout_s passes; returns done().")
      .def_property_readonly("bytes", &Request::bytes, "Bytes transferred so far.")
      .def_property_readonly("error", &Request::error, "0, or the errno of the first chunk that failed.")
      .def_property_readonly("error_offset", &Request::error_offset, "File offset where the failure happened.")
      .def_property_readonly("error_size", &Request::error_size, "Bytes of the failed chunk left undone.");

  py::class_<EngineHandle>(m, "IoEngine",
                           "An async I/O engine: 'io_uring', 'aio' (kernel AIO) or 'threads' (pread/pwrite pool).\n"
                           "Raises OSError when the kernel refuses the interface.")
      .def(py::init<const std::string&, unsigned, unsigned>(), py::arg("kind"), py::arg("queue_depth") = 32,
           py::arg("num_threads") = 4)
      .def(
          "submit",
          [](EngineHandle& e, bool write, const std::vector<Segment>& segments, size_t chunk_bytes) {
            py::gil_scoped_release release;  // kernel AIO on buffered files does the I/O inside io_submit
            return e.submit(write, segments, chunk_bytes);
          },
          py::arg("write"), py::arg("segments"), py::arg("chunk_bytes"),
          "Queue segments [(fd, direct, address, size, offset)], split into chunk_bytes pieces; returns an IoRequest.\n"
          "The memory at each address must stay valid until the request is done.")
      .def(
          "close",
          [](EngineHandle& e) {
            py::gil_scoped_release release;
            e.close();
          },
          "Wait for in-flight chunks, then stop the engine. Idempotent.")
      .def_property_readonly("name", &EngineHandle::name);
}

}  // namespace offload
