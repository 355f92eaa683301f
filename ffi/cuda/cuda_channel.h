// Channel memory on the GPUs of one process, reached through peer pointers.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "../registry.h"

namespace b12x {

// Enables peer access between every pair and checks it for real: a kernel on
// each GPU writes into and reads from every peer's memory. Returns an empty
// string when all of it worked, else what failed (drivers and VMs can report
// P2P that does not work: DESIGN §3).
std::string probe_peer_access(const std::vector<int>& ordinals);

// Allocates and zero-fills Signal, staging and a mapped host error record per
// rank. `max_blocks` is the largest grid a call may use; it must fit on the
// GPU at once (DESIGN C10) and is checked against the SM count here; 0
// takes the largest that fits, up to kMaxBlocks.
std::unique_ptr<ChannelGroup> make_cuda_group(const std::string& channel, std::vector<int> ordinals,
                                              size_t capacity_bytes, double timeout_s, int max_blocks);

}  // namespace b12x
