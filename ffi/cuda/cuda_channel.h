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
// P2P that does not work: docs/DESIGN.md, "Transports").
std::string probe_peer_access(const std::vector<int>& ordinals);

// The largest grid a group on `ordinals` (this process's devices) uses:
// `options.max_blocks`, or for 0 the smallest SM count up to kMaxBlocks.
// Throws std::invalid_argument where it does not fit a device (DESIGN C10).
int resolve_max_blocks(const ChannelOptions& options, const std::vector<int>& ordinals);

// Host-side reads of a rank's signal region on device `ordinal` (stats).
uint32_t read_device_calls(int ordinal, const Signal* signal, int rank, int world);
bool read_device_poisoned(int ordinal, const Signal* signal);
// Writes the counters of protocol.h start_signal_counters into a rank's
// signal region on device `ordinal` (ChannelGroup::start_counters).
void start_device_counters(int ordinal, Signal* signal, uint32_t calls);
// Writes Signal::generation of a rank's signal region on device `ordinal`
// (ChannelGroup::write_generation), after the device finished its work.
void write_device_generation(int ordinal, Signal* signal, uint32_t generation);

// Allocates and zero-fills Signal, staging and a mapped host error record per
// rank, and Lamport buffers filled with the "empty" word (lamport.h).
// `options.max_blocks` is the largest grid a call may use; it must fit on the
// GPU at once (DESIGN C10) and is checked against the SM count here; 0
// takes the largest that fits, up to kMaxBlocks.
std::unique_ptr<ChannelGroup> make_cuda_group(const std::string& channel, std::vector<int> ordinals,
                                              ChannelOptions options);

}  // namespace b12x
