// One asynchronous read or write as Python sees it (a Request), and the pieces it is split into (Chunks).
//
// Contract:
//  - A Request is created with the number of chunks it was split into; each engine reports every chunk
//    exactly once through finish(), from any thread. When the last chunk is reported the request is done
//    and waiters wake.
//  - The first error wins: error() is a positive errno, error_offset()/error_size() the byte range of the
//    chunk that failed. Python turns that into an OffloadIOError naming the path (native code never throws
//    on an I/O error and never aborts).
//  - A Chunk is heap-allocated, owned by the engine while in flight, and deleted by finish(). Its buffer
//    must stay valid until its request is done: offload's Python layer keeps the tensor alive for that.
#pragma once

#include <sys/uio.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

namespace offload::io {

class Request {
 public:
  explicit Request(size_t num_chunks);

  // Report one chunk: `bytes` transferred, `err` 0 or a positive errno for the range [offset, offset+size).
  void finish_chunk(size_t bytes, int err, uint64_t offset, size_t size);

  bool done() const;
  // Block until done or until timeout_s passes (negative: no limit). Returns whether it is done.
  bool wait(double timeout_s) const;

  size_t bytes() const;
  int error() const;
  uint64_t error_offset() const;
  size_t error_size() const;

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  size_t remaining_;
  size_t bytes_ = 0;
  int err_ = 0;
  uint64_t err_offset_ = 0;
  size_t err_size_ = 0;
};

enum class Op { kRead, kWrite };

// A piece of a request small enough for one system call. `done` counts bytes already transferred, so a
// short read or write resumes where it stopped.
struct Chunk {
  std::shared_ptr<Request> request;
  Op op = Op::kRead;
  int fd = -1;
  bool direct = false;  // fd was opened with O_DIRECT: every attempt must stay 4096-aligned
  char* buf = nullptr;
  size_t len = 0;
  uint64_t offset = 0;
  size_t done = 0;
  unsigned retries = 0;   // consecutive EINTR/EAGAIN, bounded so a stuck call fails instead of spinning
  struct iovec iov {};    // io_uring READV/WRITEV read this while the chunk is in flight

  char* cursor() { return buf + done; }
  size_t left() const { return len - done; }
  uint64_t position() const { return offset + done; }
};

// What an engine does with a chunk after one attempt returned `result` (bytes, or -errno).
enum class Step { kDone, kRetry, kFailed };

// Shared by every engine so EINTR, EAGAIN, short reads (end of file: ENODATA) and short writes are handled
// the same way everywhere. Advances chunk.done; on kFailed sets *err to a positive errno.
Step apply_result(Chunk& chunk, long result, int* err);

// Report the chunk to its request (err 0: success) and delete it.
void finish(Chunk* chunk, int err);

}  // namespace offload::io
