// A kernel submission/completion ring (io_uring or kernel AIO), driven by RingEngine (ring_engine.cpp).
//
// Contract:
//  - prepare() and submit() are called by one thread at a time (RingEngine holds its lock), never with
//    more than capacity() chunks in flight; reap() is called only by RingEngine's reaper thread, and may
//    run concurrently with submit() (both kernels allow that).
//  - Chunks the kernel refuses at submission come back through `refused` with -errno, to be handled like
//    any completion; nothing is lost.
#pragma once

#include <memory>
#include <vector>

#include "io/io_request.h"

namespace offload::io {

struct Completion {
  Chunk* chunk;
  long result;  // bytes transferred, or -errno
};

class Ring {
 public:
  virtual ~Ring() = default;
  virtual unsigned capacity() const = 0;
  // Queue a chunk for the next submit() (no system call).
  virtual void prepare(Chunk* chunk) = 0;
  // Hand the prepared chunks to the kernel.
  virtual void submit(std::vector<Completion>& refused) = 0;
  // Wait up to timeout_ms for at least one completion and append all that are ready.
  virtual void reap(std::vector<Completion>& out, int timeout_ms) = 0;
};

// Both throw std::system_error when the kernel does not offer the interface.
std::unique_ptr<Ring> make_uring_ring(unsigned depth);
std::unique_ptr<Ring> make_aio_ring(unsigned depth);

}  // namespace offload::io
