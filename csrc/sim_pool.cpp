// The simulated accelerator's device memory: a caching pool beside glibc's heap.
//
// Not a kernel (the house rule of stateless ops is for kernels): the one piece of process
// state in csrc/, an allocator. On `sim` the device's tensors are CPU tensors, so without
// it autograd's activations, gradients and temporaries are carved from the same glibc heap
// as the engine's host state. Their churn leaves the heap's freed holes split by
// short-lived blocks; the heap grows and keeps the free bytes, and a run's RSS then holds
// free heap that on a GPU would be the device's business (docs/BENCHMARKS.md, "The bytes
// beyond the engine's are the C heap's free memory"). CUDA's caching allocator keeps
// device blocks in device memory and reuses them; this does the same for sim:
//
// - Installed once per process as torch's CPU allocator (c10::SetCPUAllocator). Every
//   allocation first asks the calling thread's mode: "host" (the default, every thread
//   that never asked) hands it to the allocator that was installed before, unchanged;
//   "device" takes a block from the pool. SimAccelerator sets the mode around device work
//   (its `device_scope`), and back to host around host allocations inside it.
// - A device request is rounded up to a size class: four classes per power of two
//   (c, 1.25c, 1.5c, 1.75c; at most 25% over), at least 512 bytes. A freed block goes to
//   its class's free list and serves the next request of that class (a CUDA-like cache:
//   reserved memory is not given back while a simulated device is open).
// - Classes of 256 KiB and more are anonymous mappings of their own; smaller ones are
//   carved from 4 MiB mappings (chunks), so small device blocks never split the heap.
// - What the pool holds in RSS ("resident") is counted as CUDA counts reserved memory,
//   but by pages written rather than address space: a block counts the largest request it
//   served (page-rounded), a chunk the bytes carved from it. Its peak is the simulated
//   device's memory peak that a host-memory measurement subtracts from the process's RSS.
// - While no simulated device is open, a freed block is not cached: a mapping is unmapped
//   at once, and once no block carved from a chunk is in use the chunks are unmapped too (a
//   test process that opens many devices does not keep their caches).
// - It also counts the bytes asked for by live device tensors ("in use", CUDA's
//   memory_allocated) and their peak, activations and temporaries included.
//
// A DataPtr's context is its data pointer (as the default CPU allocator's), and the pool
// finds its block from the pointer, so raw_allocate / raw_deleter work for both kinds.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kMinClass = 512;
constexpr size_t kOwnMapping = 256 * 1024;  // classes from here up: a mapping each
constexpr size_t kChunk = 4 * 1024 * 1024;

thread_local int64_t t_mode = 0;  // 0 host, 1 device

size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// The size class of a request: the smallest of c, 1.25c, 1.5c, 1.75c, 2c (c the largest
// power of two below n) that holds n, a multiple of 512 bytes (of a page from kOwnMapping).
size_t size_class(size_t n) {
  if (n <= kMinClass) return kMinClass;
  size_t c = 1;
  while (c * 2 < n) c *= 2;
  size_t cls = 2 * c;
  for (size_t q = 4; q <= 7; ++q) {
    if (c / 4 * q >= n) {
      cls = c / 4 * q;
      break;
    }
  }
  cls = round_up(cls, kMinClass);
  return cls >= kOwnMapping ? round_up(cls, page_size()) : cls;
}

struct Block {
  void* ptr;
  size_t size;       // the class
  size_t written;    // resident bytes counted for it (own mappings: largest request served)
  bool own;          // an own mapping (else carved from a chunk)
  size_t asked = 0;  // the bytes asked for by the tensor on it; 0 while it is free
};

struct Stats {
  int64_t resident = 0, resident_peak = 0, in_use = 0, reserved = 0, mappings = 0,
          served = 0, in_use_peak = 0;
};

class SimPool final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (t_mode != 1 || n == 0) return prev_->allocate(n);
    void* p = take(n);
    return {p, p, &SimPool::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &SimPool::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  static SimPool& get() {
    static SimPool* pool = new SimPool();  // never destroyed: tensors may outlive exit
    return *pool;
  }

  bool install() {
    std::lock_guard<std::mutex> g(mu_);
    if (prev_ == nullptr) {
      c10::Allocator* current = c10::GetCPUAllocator();
      if (current == this) return true;
      prev_ = current;
      prev_raw_ = current->raw_deleter();
      c10::SetCPUAllocator(this, /*priority=*/1);
    }
    return c10::GetCPUAllocator() == this;
  }

  void open(int64_t delta) {
    std::lock_guard<std::mutex> g(mu_);
    opened_ += delta;
    TORCH_CHECK(opened_ >= 0, "zenflow::sim_pool_open: closed more often than opened");
    if (opened_ == 0) trim_locked();
  }

  bool owns(uintptr_t p) {
    std::lock_guard<std::mutex> g(mu_);
    return blocks_.count(reinterpret_cast<void*>(p)) != 0;
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> g(mu_);
    return {s_.resident, s_.resident_peak, s_.in_use, s_.reserved, s_.mappings, s_.served,
            opened_, s_.in_use_peak};
  }

  void reset_peak() {
    std::lock_guard<std::mutex> g(mu_);
    s_.resident_peak = s_.resident;
    s_.in_use_peak = s_.in_use;
  }

 private:
  static void release(void* p) { get().give_back(p); }

  void* take(size_t n) {
    const size_t cls = size_class(n);
    std::lock_guard<std::mutex> g(mu_);
    Block* b = nullptr;
    auto& free_list = free_[cls];
    if (!free_list.empty()) {
      b = free_list.back();
      free_list.pop_back();
    } else {
      b = cls >= kOwnMapping ? map_block(cls) : carve(cls);
    }
    if (b->own) {  // resident: the largest request it served, in pages
      const size_t w = round_up(n, page_size());
      if (w > b->written) {
        s_.resident += static_cast<int64_t>(w - b->written);
        b->written = w;
      }
    }
    b->asked = n;
    if (!b->own) carved_live_ += 1;
    s_.in_use += static_cast<int64_t>(n);
    s_.in_use_peak = std::max(s_.in_use_peak, s_.in_use);
    s_.served += 1;
    s_.resident_peak = std::max(s_.resident_peak, s_.resident);
    return b->ptr;
  }

  Block* map_block(size_t cls) {
    void* p = mmap(nullptr, cls, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(p != MAP_FAILED, "zenflow::sim_pool: the simulated device could not map ",
                cls, " bytes (host memory exhausted)");
    s_.reserved += static_cast<int64_t>(cls);
    s_.mappings += 1;
    Block* b = new Block{p, cls, 0, true};
    blocks_[p] = b;
    return b;
  }

  Block* carve(size_t cls) {
    if (chunks_.empty() || chunk_used_ + cls > kChunk) {
      void* p = mmap(nullptr, kChunk, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                     0);
      TORCH_CHECK(p != MAP_FAILED, "zenflow::sim_pool: the simulated device could not map ",
                  kChunk, " bytes (host memory exhausted)");
      chunks_.push_back(p);
      chunk_used_ = 0;
      s_.reserved += static_cast<int64_t>(kChunk);
      s_.mappings += 1;
    }
    void* p = static_cast<char*>(chunks_.back()) + chunk_used_;
    chunk_used_ += cls;
    s_.resident += static_cast<int64_t>(cls);
    Block* b = new Block{p, cls, cls, false};
    blocks_[p] = b;
    return b;
  }

  void give_back(void* p) {
    std::unique_lock<std::mutex> g(mu_);
    auto it = blocks_.find(p);
    if (it == blocks_.end()) {  // not the pool's: the allocator installed before
      g.unlock();
      if (prev_raw_ != nullptr) prev_raw_(p);
      return;
    }
    Block* b = it->second;
    s_.in_use -= static_cast<int64_t>(b->asked);
    b->asked = 0;
    if (!b->own) carved_live_ -= 1;
    if (opened_ == 0 && b->own) {  // no device open: nothing is cached
      unmap(b);
      return;
    }
    free_[b->size].push_back(b);
    if (opened_ == 0 && carved_live_ == 0) trim_locked();
  }

  void unmap(Block* b) {
    munmap(b->ptr, b->size);
    s_.reserved -= static_cast<int64_t>(b->size);
    s_.resident -= static_cast<int64_t>(b->written);
    s_.mappings -= 1;
    blocks_.erase(b->ptr);
    delete b;
  }

  // Unmap every cached own mapping; the chunks too when no carved block is in use.
  void trim_locked() {
    for (auto& kv : free_) {
      std::vector<Block*> keep;
      for (Block* b : kv.second) {
        if (b->own) {
          unmap(b);
        } else {
          keep.push_back(b);
        }
      }
      kv.second.swap(keep);
    }
    if (carved_live_ != 0) return;
    for (auto& kv : free_) {
      for (Block* b : kv.second) {
        s_.resident -= static_cast<int64_t>(b->written);
        blocks_.erase(b->ptr);
        delete b;
      }
      kv.second.clear();
    }
    for (void* c : chunks_) munmap(c, kChunk);
    s_.reserved -= static_cast<int64_t>(kChunk * chunks_.size());
    s_.mappings -= static_cast<int64_t>(chunks_.size());
    chunks_.clear();
    chunk_used_ = 0;
  }

  std::mutex mu_;
  c10::Allocator* prev_ = nullptr;
  c10::DeleterFnPtr prev_raw_ = nullptr;
  int64_t opened_ = 0;
  std::unordered_map<void*, Block*> blocks_;  // every block the pool made
  int64_t carved_live_ = 0;                   // blocks from chunks in use
  std::unordered_map<size_t, std::vector<Block*>> free_;  // class -> cached blocks
  std::vector<void*> chunks_;
  size_t chunk_used_ = 0;
  Stats s_;
};

bool sim_pool_install() { return SimPool::get().install(); }

// The calling thread's allocation mode (0 host, 1 device) -> the mode it had.
int64_t sim_pool_mode(int64_t mode) {
  TORCH_CHECK(mode == 0 || mode == 1, "zenflow::sim_pool_mode: mode must be 0 or 1, got ", mode);
  const int64_t old = t_mode;
  t_mode = mode;
  return old;
}

void sim_pool_open(int64_t delta) { SimPool::get().open(delta); }

bool sim_pool_owns(int64_t ptr) { return SimPool::get().owns(static_cast<uintptr_t>(ptr)); }

// [resident, resident_peak, in_use, reserved, mappings, served, opened, in_use_peak]
std::vector<int64_t> sim_pool_stats() { return SimPool::get().stats(); }

void sim_pool_reset_peak() { SimPool::get().reset_peak(); }


}  // namespace

TORCH_LIBRARY_FRAGMENT(zenflow, m) {
  m.def("sim_pool_install() -> bool", &sim_pool_install);
  m.def("sim_pool_mode(int mode) -> int", &sim_pool_mode);
  m.def("sim_pool_open(int delta) -> ()", &sim_pool_open);
  m.def("sim_pool_owns(int ptr) -> bool", &sim_pool_owns);
  m.def("sim_pool_stats() -> int[]", &sim_pool_stats);
  m.def("sim_pool_reset_peak() -> ()", &sim_pool_reset_peak);
}
