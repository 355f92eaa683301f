// A custom call that launches an empty kernel, bound exactly like the
// collectives (stream, ordinal, one buffer in and out, kCmdBufferCompatible).
// benchmarks/all_reduce.py chains it to measure what XLA charges per FFI call
// on the machine, so a collective's time can be split into dispatch and work.
#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace b12x {
namespace {

__global__ void empty_kernel() {}

// The output aliases the input (the caller declares it), so chained probes
// form a dependency chain and nothing is copied.
ffi::Error DispatchProbe(cudaStream_t stream, int32_t, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) {
  empty_kernel<<<1, 32, 0, stream>>>();
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("dispatch probe: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace b12x

XLA_FFI_DEFINE_HANDLER_SYMBOL(b12x_dispatch_probe_cuda, b12x::DispatchProbe,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
