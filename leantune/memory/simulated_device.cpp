// A device guard for torch's PrivateUse1 backend that keeps no state beyond "the current device
// index": enough for fake tensors on that backend to run autograd, checkpointing and copies, while
// no memory is ever allocated. Loaded by leantune/memory/simulated.py, which renames the backend.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

C10_REGISTER_GUARD_IMPL(PrivateUse1, c10::impl::FakeGuardImpl<c10::DeviceType::PrivateUse1>);
