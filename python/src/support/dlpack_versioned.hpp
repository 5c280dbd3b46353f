// DLPack 1.0's versioned tensor, the struct behind a "dltensor_versioned" capsule (the
// Python array API's __dlpack__ with max_version >= (1, 0)). Debian 12's libdlpack-dev is
// DLPack 0.6, whose dlpack.h has the unversioned DLManagedTensor only, so the 1.0 parts
// are defined here, field for field as DLPack 1.0's dlpack.h has them (DLPackVersion,
// DLManagedTensorVersioned and its flags), around 0.6's DLTensor, whose layout 1.0 kept.
// They live in a namespace of their own, so a newer dlpack.h defining the same names
// does not clash.
#pragma once

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>

namespace meshrt::python::dlpack {

// DLPackVersion: a "dltensor_versioned" capsule's tensor says which DLPack it follows.
struct Version {
  std::uint32_t major;
  std::uint32_t minor;
};

// DLManagedTensorVersioned.
struct ManagedTensorVersioned {
  Version version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned* self);
  std::uint64_t flags;
  DLTensor dl_tensor;
};

// DLPACK_FLAG_BITMASK_READ_ONLY: the consumer must not write the memory.
constexpr std::uint64_t kFlagReadOnly = 1ULL << 0;
// DLPACK_FLAG_BITMASK_IS_COPIED: the producer copied the data for this export.
constexpr std::uint64_t kFlagIsCopied = 1ULL << 1;

// The DLPack version meshrt speaks in versioned capsules.
constexpr Version kVersion{1, 0};

// kDLBool (DLPack 0.8): one byte holding 0 or 1. Exported as such in versioned capsules
// only, whose consumers speak a DLPack that has it; unversioned capsules carry bool as
// uint8, since numpy 1.24 and torch 1.13 accept no kDLBool.
constexpr std::uint8_t kDLBoolCode = 6;

// The capsule names of the Python DLPack protocol: a consumer renames the capsule it took.
inline constexpr const char* kCapsule = "dltensor";
inline constexpr const char* kUsedCapsule = "used_dltensor";
inline constexpr const char* kVersionedCapsule = "dltensor_versioned";
inline constexpr const char* kUsedVersionedCapsule = "used_dltensor_versioned";

static_assert(offsetof(ManagedTensorVersioned, flags) == 24 && offsetof(ManagedTensorVersioned, dl_tensor) == 32,
              "DLManagedTensorVersioned's layout is DLPack 1.0's");

}  // namespace meshrt::python::dlpack
