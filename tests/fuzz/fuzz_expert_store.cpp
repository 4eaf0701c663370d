// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the expert store reader (moe::offload::ExpertStore): arbitrary bytes must
// either be rejected with moe::Error or give a store whose every record lies 4 KiB-aligned inside
// the file, in order, and reads without error. The bytes are handed over as a file (a memfd):
// the reader works on file descriptors. Built with clang -fsanitize=fuzzer,address,undefined by
// the "fuzz: expert_store libFuzzer" test, and with the normal compiler into
// moe_fuzz_replay_expert_store (tests/fuzz/replay_main.cpp).
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "moe/core/error.hpp"
#include "moe/offload/store.hpp"

namespace {

// A broken invariant: abort, so that libFuzzer and the sanitizers record the input.
void require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

/// Reads `data` as an expert store file; returns 1 if it was accepted, 0 if it was rejected.
extern "C" int moe_fuzz_one(std::uint8_t const* data, std::size_t size) {
  namespace off = moe::offload;
  int const fd = ::memfd_create("fuzz.moex", MFD_CLOEXEC);
  require(fd >= 0);
  std::size_t done = 0;
  while (done < size) {
    ssize_t const w = ::write(fd, data + done, size - done);
    require(w > 0);
    done += static_cast<std::size_t>(w);
  }
  std::string const path = "/proc/self/fd/" + std::to_string(fd);
  int accepted = 0;
  try {
    off::ExpertStore const store(path);
    accepted = 1;
    off::StoreShape const& s = store.shape();
    require(s.num_layers >= 1 && s.num_experts >= 1);
    std::uint64_t previous = 0, total = 0;
    for (moe::Index l = 0; l < s.num_layers; ++l) {
      for (off::StoreRecord const& r : store.layer_records(l)) {
        require(r.offset % off::kStoreAlign == 0 && r.offset >= previous && r.bytes % 64 == 0);
        require(r.offset + r.read_bytes() <= size);
        previous = r.offset + r.read_bytes();
        total += r.read_bytes();
      }
    }
    require(total <= size);
    // Every record reads (bounded: the records are disjoint parts of the input).
    for (moe::Index l = 0; l < s.num_layers; ++l) {
      for (moe::Index e = 0; e < s.num_experts; ++e) {
        off::RecordBuffer buf(store.record(l, e).bytes);
        store.read(l, e, buf.data());
      }
    }
  } catch (moe::Error const&) {
    // rejected
  }
  ::close(fd);
  return accepted;
}

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  (void)moe_fuzz_one(data, size);
  return 0;
}
