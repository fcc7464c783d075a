// Linux kernel AIO through raw syscalls: no libaio, only <linux/aio_abi.h> and syscall().
// Truly asynchronous only with O_DIRECT; on buffered files io_submit does the I/O before it returns.
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "io/ring.h"

namespace offload::io {
namespace {

class AioRing final : public Ring {
 public:
  explicit AioRing(unsigned depth) : capacity_(depth), events_(depth) {
    if (syscall(__NR_io_setup, depth, &ctx_) < 0) throw std::system_error(errno, std::generic_category(), "io_setup");
    prepared_.reserve(depth);
    pointers_.reserve(depth);
  }
  ~AioRing() override { syscall(__NR_io_destroy, ctx_); }

  unsigned capacity() const override { return capacity_; }

  void prepare(Chunk* c) override {
    iocb cb;
    std::memset(&cb, 0, sizeof cb);
    cb.aio_data = reinterpret_cast<uint64_t>(c);
    cb.aio_lio_opcode = c->op == Op::kRead ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
    cb.aio_fildes = static_cast<uint32_t>(c->fd);
    cb.aio_buf = reinterpret_cast<uint64_t>(c->cursor());
    cb.aio_nbytes = c->left();
    cb.aio_offset = static_cast<int64_t>(c->position());
    prepared_.push_back(cb);
  }

  void submit(std::vector<Completion>& refused) override {
    pointers_.clear();
    for (iocb& cb : prepared_) pointers_.push_back(&cb);
    size_t next = 0;
    while (next < pointers_.size()) {
      long r = syscall(__NR_io_submit, ctx_, static_cast<long>(pointers_.size() - next), pointers_.data() + next);
      if (r > 0) {
        next += static_cast<size_t>(r);
      } else {  // the first remaining iocb was refused (r < 0) or none taken (r == 0): hand it back
        long err = r < 0 ? errno : EAGAIN;
        refused.push_back({reinterpret_cast<Chunk*>(pointers_[next]->aio_data), -err});
        ++next;
      }
    }
    prepared_.clear();
  }

  void reap(std::vector<Completion>& out, int timeout_ms) override {
    timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
    long n = syscall(__NR_io_getevents, ctx_, 1L, static_cast<long>(events_.size()), events_.data(), &ts);
    for (long i = 0; i < n; ++i) {
      out.push_back({reinterpret_cast<Chunk*>(events_[i].data), static_cast<long>(events_[i].res)});
    }
  }

 private:
  aio_context_t ctx_ = 0;
  unsigned capacity_;
  std::vector<io_event> events_;
  std::vector<iocb> prepared_;
  std::vector<iocb*> pointers_;
};

}  // namespace

std::unique_ptr<Ring> make_aio_ring(unsigned depth) { return std::make_unique<AioRing>(depth); }

}  // namespace offload::io
