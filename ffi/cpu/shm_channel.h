// Channel memory in POSIX shared memory, for CPU processes that share a
// channel (the host analog of CUDA IPC, so CI runs the multi-process path).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "../shared_group.h"

namespace b12x {

// Creates one shared-memory segment per local rank (Signal and staging
// zero-filled, then the Lamport region filled with the empty word) and a
// private error record; `ordinals[r]` is kRemoteRank for the
// ranks other processes hold, whose segments `open` maps by name.
std::unique_ptr<SharedGroup> make_shm_group(const std::string& channel, std::vector<int> ordinals,
                                            const ChannelOptions& options);

}  // namespace b12x
