// HostArena: one region of host memory, mapped once at its full budget, handed out as 4 KiB-aligned leases.
//
// Why an arena and not malloc per buffer:
//  - a hard budget: the region never grows, so offload can never eat host RAM past what the user allowed
//    (the OOM-killer "exit -9" of other tools, NEEDS.md P4);
//  - alignment for O_DIRECT for free: the region is page-aligned and every lease starts on a 4 KiB boundary;
//  - page-locking (for CUDA) is done once for the whole region, not per buffer, by the Python layer.
//
// Allocation is first-fit over a free list ordered by offset; freed ranges coalesce with their neighbours,
// so a pool used in a steady pattern (the engine's staging ring) returns to one free range when idle.
// Thread-safe. When no range fits, allocate() either throws ArenaExhausted or waits for a release.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

namespace offload {

// The request cannot be satisfied within the budget (now, or within the timeout when waiting).
class ArenaExhausted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ArenaStats {
  size_t capacity = 0;       // bytes mapped (the budget, rounded up to the alignment)
  size_t in_use = 0;         // bytes currently leased (rounded sizes)
  size_t peak_in_use = 0;    // high-water mark of in_use
  size_t largest_free = 0;   // the largest lease that would succeed now
  size_t live_leases = 0;
  uint64_t total_leases = 0; // leases ever made
};

class HostArena {
 public:
  static constexpr size_t kAlignment = 4096;

  // Maps `capacity` bytes (rounded up to kAlignment) of anonymous memory, reserved lazily: pages are
  // committed when first touched. Throws std::runtime_error naming errno when the mapping fails.
  explicit HostArena(size_t capacity);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // Returns the offset of a free range of at least `nbytes` (rounded up to kAlignment; 0 bytes takes one
  // page). wait=false: throws ArenaExhausted at once when nothing fits. wait=true: blocks until a release
  // makes room, up to timeout_s (< 0: forever), then throws ArenaExhausted. A request larger than the whole
  // capacity throws at once, even when waiting: it could never succeed.
  size_t allocate(size_t nbytes, bool wait, double timeout_s);

  // Returns a range obtained from allocate(); wakes waiters. Unknown offsets are ignored (never abort).
  void release(size_t offset);

  uint8_t* base() const { return base_; }
  size_t capacity() const { return capacity_; }
  ArenaStats stats() const;

  static size_t round_up(size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

 private:
  bool try_allocate_locked(size_t rounded, size_t* offset);
  size_t largest_free_locked() const;
  std::string exhausted_message(size_t nbytes) const;

  uint8_t* base_ = nullptr;
  size_t capacity_ = 0;
  mutable std::mutex mu_;
  std::condition_variable released_;
  std::map<size_t, size_t> free_;   // offset -> length, non-adjacent (coalesced)
  std::map<size_t, size_t> live_;   // offset -> length
  size_t in_use_ = 0;
  size_t peak_in_use_ = 0;
  uint64_t total_leases_ = 0;
};

}  // namespace offload
