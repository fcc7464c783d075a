#include "buffers/host_arena.h"

#include <sys/mman.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace offload {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// The budget rounded up to the alignment, refused when that (or the 2 MiB alignment slack) would wrap
// around: a wrapped size would map a few bytes and hand out leases far beyond them.
size_t checked_capacity(size_t capacity) {
  const size_t largest = std::numeric_limits<size_t>::max() / 2;
  if (capacity > largest) {
    throw std::invalid_argument("staging pool budget of " + std::to_string(capacity) +
                                " bytes is larger than any machine's memory: pass a budget in bytes, e.g. 8 << 30");
  }
  return HostArena::round_up(capacity == 0 ? 1 : capacity);
}

}  // namespace

HostArena::HostArena(size_t capacity) : capacity_(checked_capacity(capacity)) {
  // Regions of 2 MiB and more start on a 2 MiB boundary (map the slack, unmap it) so huge pages can back
  // all of them; mmap alone only promises 4 KiB alignment.
  const size_t slack = capacity_ >= kHugePage ? kHugePage : 0;
  void* p = mmap(nullptr, capacity_ + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    throw std::runtime_error("mmap of " + std::to_string(capacity_) + " bytes for the staging pool failed: " +
                             std::strerror(err));
  }
  auto* raw = static_cast<uint8_t*>(p);
  base_ = raw;
  if (slack != 0) {
    const uintptr_t address = reinterpret_cast<uintptr_t>(raw);
    base_ = reinterpret_cast<uint8_t*>((address + kHugePage - 1) / kHugePage * kHugePage);
    const size_t head = static_cast<size_t>(base_ - raw);
    if (head != 0) munmap(raw, head);
    if (slack - head != 0) munmap(base_ + capacity_, slack - head);
  }
#ifdef MADV_HUGEPAGE
  // Every O_DIRECT request pins its buffer's pages; 2 MiB pages make that (and the TLB) far cheaper:
  // the nvme tier's system time fell from ~18 to ~10 ms per step on the benchmark model. Advice only.
  madvise(base_, capacity_, MADV_HUGEPAGE);
#endif
  free_.emplace(0, capacity_);
}

HostArena::~HostArena() {
  if (base_ != nullptr) munmap(base_, capacity_);
}

bool HostArena::try_allocate_locked(size_t rounded, size_t* offset) {
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < rounded) continue;
    *offset = it->first;
    size_t remaining = it->second - rounded;
    free_.erase(it);
    if (remaining > 0) free_.emplace(*offset + rounded, remaining);
    live_.emplace(*offset, rounded);
    in_use_ += rounded;
    if (in_use_ > peak_in_use_) peak_in_use_ = in_use_;
    ++total_leases_;
    return true;
  }
  return false;
}

size_t HostArena::largest_free_locked() const {
  size_t best = 0;
  for (const auto& [off, len] : free_) best = len > best ? len : best;
  return best;
}

std::string HostArena::exhausted_message(size_t nbytes) const {
  return "staging pool exhausted: a lease of " + std::to_string(nbytes) + " bytes does not fit (budget " +
         std::to_string(capacity_) + " bytes, " + std::to_string(in_use_) + " leased in " +
         std::to_string(live_.size()) + " buffers, largest free range " + std::to_string(largest_free_locked()) +
         " bytes)";
}

size_t HostArena::allocate(size_t nbytes, bool wait, double timeout_s) {
  const size_t rounded = round_up(nbytes == 0 ? 1 : nbytes);
  std::unique_lock<std::mutex> lock(mu_);
  if (rounded > capacity_) throw ArenaExhausted(exhausted_message(nbytes) + "; it is larger than the whole budget");
  size_t offset = 0;
  if (try_allocate_locked(rounded, &offset)) return offset;
  if (!wait) throw ArenaExhausted(exhausted_message(nbytes));
  auto fits = [&] { return try_allocate_locked(rounded, &offset); };
  if (timeout_s < 0) {
    released_.wait(lock, fits);
    return offset;
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  if (released_.wait_until(lock, deadline, fits)) return offset;
  throw ArenaExhausted(exhausted_message(nbytes) + " after waiting " + std::to_string(timeout_s) + " s");
}

void HostArena::release(size_t offset) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto live = live_.find(offset);
    if (live == live_.end()) return;
    size_t len = live->second;
    live_.erase(live);
    in_use_ -= len;
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && offset + len == next->first) {  // merge with the range after
      len += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {  // merge with the range before
        prev->second += len;
        len = 0;
      }
    }
    if (len > 0) free_.emplace(offset, len);
  }
  released_.notify_all();
}

ArenaStats HostArena::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ArenaStats s;
  s.capacity = capacity_;
  s.in_use = in_use_;
  s.peak_in_use = peak_in_use_;
  s.largest_free = largest_free_locked();
  s.live_leases = live_.size();
  s.total_leases = total_leases_;
  return s;
}

}  // namespace offload
