// Channel memory in host memory, for the devices of one process.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "../registry.h"

namespace b12x {

// The host backends' starting view (base_view): one "block" per call, all of
// a call in one cell of the staging or of the Lamport buffers.
ChannelView host_base_view(const ChannelOptions& options, int world);

// A local rank's completed calls (barriers and Lamport calls together, as on
// CUDA) and poison flag, read from host memory.
uint32_t read_host_calls(const ChannelView& v);
bool read_host_poisoned(const ChannelView& v);
// ChannelGroup::start_counters of the host groups: the local ranks' Signals,
// once no call of the group is queued.
void start_host_counters(const ChannelGroup& group, uint32_t calls);

// Allocates one Signal, one staging region (zero-filled), one Lamport region
// (filled with the empty word, lamport.h) and one error record per rank;
// every rank sees every other rank's memory directly.
std::unique_ptr<ChannelGroup> make_host_group(const std::string& channel, std::vector<int> ordinals,
                                              const ChannelOptions& options);

}  // namespace b12x
