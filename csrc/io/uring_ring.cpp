// io_uring through raw syscalls: no liburing, only <linux/io_uring.h> and syscall().
// READV/WRITEV (kernel 5.1+) rather than READ/WRITE (5.6+) so older kernels with io_uring still work.
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "io/ring.h"

namespace offload::io {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}
int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags, void* arg, size_t argsz) {
  return static_cast<int>(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, arg, argsz));
}

template <typename T>
T load_acquire(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <typename T>
void store_release(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

class UringRing final : public Ring {
 public:
  explicit UringRing(unsigned depth) {
    io_uring_params params;
    std::memset(&params, 0, sizeof params);
    fd_ = sys_setup(depth, &params);
    if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "io_uring_setup");
    capacity_ = params.sq_entries;
    sq_bytes_ = params.sq_off.array + params.sq_entries * sizeof(unsigned);
    cq_bytes_ = params.cq_off.cqes + params.cq_entries * sizeof(io_uring_cqe);
    single_mmap_ = (params.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single_mmap_) sq_bytes_ = cq_bytes_ = std::max(sq_bytes_, cq_bytes_);
    sq_ptr_ = map(sq_bytes_, IORING_OFF_SQ_RING);
    cq_ptr_ = single_mmap_ ? sq_ptr_ : map(cq_bytes_, IORING_OFF_CQ_RING);
    sqes_bytes_ = params.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(map(sqes_bytes_, IORING_OFF_SQES));
    char* sq = static_cast<char*>(sq_ptr_);
    char* cq = static_cast<char*>(cq_ptr_);
    sq_head_ = reinterpret_cast<unsigned*>(sq + params.sq_off.head);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + params.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + params.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + params.sq_off.array);
    cq_head_ = reinterpret_cast<unsigned*>(cq + params.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + params.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + params.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + params.cq_off.cqes);
    local_tail_ = *sq_tail_;
    ext_arg_ = (params.features & IORING_FEAT_EXT_ARG) != 0;
    async_reads_ = (params.features & IORING_FEAT_RW_CUR_POS) != 0;  // 5.6, as IOSQE_ASYNC
  }

  ~UringRing() override { release(); }

  unsigned capacity() const override { return capacity_; }

  void prepare(Chunk* c) override {
    unsigned index = local_tail_ & sq_mask_;
    io_uring_sqe* sqe = &sqes_[index];
    std::memset(sqe, 0, sizeof *sqe);
    c->iov.iov_base = c->cursor();
    c->iov.iov_len = c->left();
    sqe->opcode = c->op == Op::kRead ? IORING_OP_READV : IORING_OP_WRITEV;
    // A read the kernel can serve at once (the page cache, a fast device) is otherwise done inside
    // io_uring_enter, on the submitting thread: the training thread's reads ahead would wait for them.
    // IOSQE_ASYNC (5.6+; older kernels reject it) hands reads to the kernel's workers; writes already return.
    if (c->op == Op::kRead && async_reads_) sqe->flags = IOSQE_ASYNC;
    sqe->fd = c->fd;
    sqe->addr = reinterpret_cast<uint64_t>(&c->iov);
    sqe->len = 1;
    sqe->off = c->position();
    sqe->user_data = reinterpret_cast<uint64_t>(c);
    sq_array_[index] = index;
    ++local_tail_;
    store_release(sq_tail_, local_tail_);
  }

  void submit(std::vector<Completion>&) override {
    // Entries the kernel did not take (EAGAIN/EBUSY) stay in the ring and go with the next call.
    for (int attempt = 0; attempt < 3; ++attempt) {
      unsigned waiting = local_tail_ - load_acquire(sq_head_);
      if (waiting == 0) return;
      int r = sys_enter(fd_, waiting, 0, 0, nullptr, 0);
      if (r >= 0 || (errno != EINTR && errno != EAGAIN && errno != EBUSY)) return;
    }
  }

  void reap(std::vector<Completion>& out, int timeout_ms) override {
    if (!drain(out)) {
      if (ext_arg_) {
        __kernel_timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1000000LL};
        io_uring_getevents_arg arg;
        std::memset(&arg, 0, sizeof arg);
        arg.ts = reinterpret_cast<uint64_t>(&ts);
        sys_enter(fd_, 0, 1, IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG, &arg, sizeof arg);
      } else {
        sys_enter(fd_, 0, 1, IORING_ENTER_GETEVENTS, nullptr, 0);
      }
      drain(out);
    }
  }

 private:
  void* map(size_t bytes, off_t where) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, where);
    if (p == MAP_FAILED) {
      int e = errno;
      release();
      throw std::system_error(e, std::generic_category(), "io_uring mmap");
    }
    return p;
  }

  void release() {
    if (sqes_) munmap(sqes_, sqes_bytes_);
    if (cq_ptr_ && !single_mmap_) munmap(cq_ptr_, cq_bytes_);
    if (sq_ptr_) munmap(sq_ptr_, sq_bytes_);
    if (fd_ >= 0) close(fd_);
    sqes_ = nullptr;
    sq_ptr_ = cq_ptr_ = nullptr;
    fd_ = -1;
  }

  bool drain(std::vector<Completion>& out) {
    unsigned head = *cq_head_;
    unsigned tail = load_acquire(cq_tail_);
    if (head == tail) return false;
    for (; head != tail; ++head) {
      const io_uring_cqe& cqe = cqes_[head & cq_mask_];
      out.push_back({reinterpret_cast<Chunk*>(cqe.user_data), static_cast<long>(cqe.res)});
    }
    store_release(cq_head_, head);
    return true;
  }

  int fd_ = -1;
  unsigned capacity_ = 0;
  bool single_mmap_ = false;
  bool ext_arg_ = false;
  bool async_reads_ = false;
  size_t sq_bytes_ = 0, cq_bytes_ = 0, sqes_bytes_ = 0;
  void* sq_ptr_ = nullptr;
  void* cq_ptr_ = nullptr;
  io_uring_sqe* sqes_ = nullptr;
  unsigned *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_array_ = nullptr;
  unsigned *cq_head_ = nullptr, *cq_tail_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
  unsigned local_tail_ = 0;
};

}  // namespace

std::unique_ptr<Ring> make_uring_ring(unsigned depth) { return std::make_unique<UringRing>(depth); }

}  // namespace offload::io
