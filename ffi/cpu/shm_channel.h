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

// Unlinks the shared-memory name of a peer's export (a failed preparation:
// the peer may have died holding it); names that are not b12x_jax's are
// left alone.
void unlink_shm_export(const std::string& exported);

}  // namespace b12x
