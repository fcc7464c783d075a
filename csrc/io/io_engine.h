// An I/O engine runs chunks asynchronously. Three kinds, chosen by measurement in Python:
//   "io_uring"  io_uring through raw syscalls (<linux/io_uring.h>, no liburing)
//   "aio"       Linux kernel AIO through raw syscalls (<linux/aio_abi.h>, no libaio)
//   "threads"   a pool of threads doing pread/pwrite
// None needs a library beyond libc, so the build never depends on liburing or libaio being installed.
//
// Contract:
//  - submit() takes ownership of the chunks and returns without waiting for them (it may block briefly
//    when kernel AIO runs buffered I/O synchronously inside io_submit).
//  - Every chunk is finished exactly once (io_request.h), with an errno rather than an exception.
//  - Destruction drains: it waits for every submitted chunk, then stops the engine's threads.
//  - No global state: each engine owns its ring/threads; several engines may coexist.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "io/io_request.h"

namespace offload::io {

class Engine {
 public:
  virtual ~Engine() = default;
  virtual void submit(std::vector<Chunk*>& chunks) = 0;
  virtual const char* name() const = 0;
};

// Build an engine of `kind` ("io_uring", "aio", "threads"). Throws std::system_error with the errno when
// the kernel refuses it (e.g. io_uring disabled by sysctl or seccomp), std::invalid_argument for a bad kind.
std::unique_ptr<Engine> make_engine(const std::string& kind, unsigned queue_depth, unsigned num_threads);

}  // namespace offload::io
