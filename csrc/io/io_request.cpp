#include "io/io_request.h"

#include <cerrno>
#include <chrono>

namespace offload::io {

namespace {
constexpr unsigned kMaxRetries = 1000;
constexpr uint64_t kDirectAlign = 4096;
}  // namespace

Request::Request(size_t num_chunks) : remaining_(num_chunks) {}

void Request::finish_chunk(size_t bytes, int err, uint64_t offset, size_t size) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    bytes_ += bytes;
    if (err != 0 && err_ == 0) {
      err_ = err;
      err_offset_ = offset;
      err_size_ = size;
    }
    if (remaining_ > 0) --remaining_;
    if (remaining_ != 0) return;
  }
  cv_.notify_all();
}

bool Request::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return remaining_ == 0;
}

bool Request::wait(double timeout_s) const {
  std::unique_lock<std::mutex> lock(mu_);
  auto is_done = [this] { return remaining_ == 0; };
  if (timeout_s < 0) {
    cv_.wait(lock, is_done);
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), is_done);
}

size_t Request::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}
int Request::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return err_;
}
uint64_t Request::error_offset() const {
  std::lock_guard<std::mutex> lock(mu_);
  return err_offset_;
}
size_t Request::error_size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return err_size_;
}

Step apply_result(Chunk& chunk, long result, int* err) {
  if (result < 0) {
    int e = static_cast<int>(-result);
    if ((e == EINTR || e == EAGAIN) && ++chunk.retries < kMaxRetries) return Step::kRetry;
    *err = e;
    return Step::kFailed;
  }
  chunk.retries = 0;
  if (result == 0 && chunk.left() > 0) {
    // A read at end of file (a truncated or short file), or a write the kernel refused to make progress on.
    *err = chunk.op == Op::kRead ? ENODATA : EIO;
    return Step::kFailed;
  }
  chunk.done += static_cast<size_t>(result);
  if (chunk.left() == 0) return Step::kDone;
  if (chunk.direct && chunk.position() % kDirectAlign != 0) {
    // O_DIRECT cannot resume at an unaligned position: a short direct read means end of file.
    *err = chunk.op == Op::kRead ? ENODATA : EIO;
    return Step::kFailed;
  }
  return Step::kRetry;
}

void finish(Chunk* chunk, int err) {
  size_t failed_len = err ? chunk->left() : 0;
  chunk->request->finish_chunk(chunk->done, err, chunk->position(), failed_len);
  delete chunk;
}

}  // namespace offload::io
