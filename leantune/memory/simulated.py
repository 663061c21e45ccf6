"""A simulated GPU: run the real memory engine at full size on a CPU-only torch and count the bytes
that would live on the GPU.

Why: no GPU may be at hand, yet the engine's schedule (streaming slots, fp8, checkpointing,
offload, LoRA, optimizer) decides the VRAM peak, and the planner predicts that peak. Running the
real code on tensors that have shapes, dtypes and devices but no data measures it in about a minute
for full-size Flux, with ~0.5 GiB of RAM.

How:
- torch's PrivateUse1 backend is renamed to "fakegpu" and given a device guard
  (c10's `FakeGuardImpl`, from the C++ file next to this one, compiled with g++ against the headers
  in the torch wheel at first use and cached). A guard written in Python is not enough: autograd's
  device threads call into it from C++. The library is built and loaded by leantune/native.py's
  rules, as the host kernels are: into $LEANTUNE_CACHE_DIR/simulated_device/, a folder only this
  user can write, with its sha256 recorded beside it; only those bytes are loaded, from a private
  copy; a damaged or stale one is rebuilt once; where it cannot be had, SimulatedDeviceUnavailable
  says why in one sentence naming the path.
- Every tensor is a `FakeTensor` (torch's FakeTensorMode): "fakegpu:0" is the GPU and "fakegpu:1"
  is host RAM. Host RAM is a second index of the same backend, not "cpu", because a parameter's
  `.data` may be swapped only between tensors of compatible types (the engine re-points streamed
  weights between host buffers and device slots); torch counts CPU and CUDA as compatible, but
  not CPU and a PrivateUse1 backend. Autograd, non-reentrant checkpointing and copies between the
  two work as on CUDA; data from real CPU tensors (a loader's batch) is copied in as on CUDA.
- `DeviceMemoryTracker`, a dispatch mode, adds the bytes of every storage an op creates to its
  device and subtracts them when the storage dies: live and peak bytes per device, which is what
  torch.cuda.max_memory_allocated would report, without the caching allocator's rounding.
- What a CUDA build would do differently on this backend is put back: attention goes to the flash
  kernel, or with a mask to the memory-efficient one (on fake devices SDPA would pick the math
  kernel and materialise the L x L matrix), and
  bf16 autocast follows CUDA's op lists (the backend has no autocast kernels of its own).
- Models are built on the meta device and then given fake parameters (`fake_parameters`): peft and
  `.to()` do not work on fake parameters, but they work on meta ones.

What it cannot see: allocator rounding and fragmentation (reserved vs allocated), the CUDA context,
cuBLAS and attention workspaces, memory kept alive by `record_stream` until a side-stream copy
ends, the copy streams themselves (this counts bytes, not time), and which attention kernel a real
GPU picks. Keep the planner's allocator margin and workspace term apart when comparing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import threading
import weakref
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import native

BACKEND = "fakegpu"
GPU = f"{BACKEND}:0"                 # the simulated GPU (a device string: valid once enable() ran)
HOST = f"{BACKEND}:1"                # host RAM in the simulation (see the module docstring)
SOURCE = Path(__file__).with_name("simulated_device.cpp")


class SimulatedDeviceUnavailable(RuntimeError):
    """The simulated device cannot be set up here (no compiler, no torch headers, or PrivateUse1
    is taken by another backend); the message says which and what to do."""


# -- the device guard library ------------------------------------------------------------------------

def cache_dir() -> Path:
    """Where the compiled guard library is kept: $LEANTUNE_CACHE_DIR, else ~/.cache/leantune."""
    return native.cache_root() / _GuardLibrary.folder


def find_compiler() -> str | None:
    """The C++ compiler to build with: $CXX if set, else g++ on PATH."""
    return shutil.which(os.environ.get("CXX") or "g++")


class _GuardLibrary(native.NativeLibrary):
    """The device guard's library (native.py builds, records, checks and loads it). Its file name
    carries a hash of the source, the torch version and the compiler, so a new torch builds a new
    library; torch loads it (the guard registers itself as it loads)."""

    folder = "simulated_device"

    def __init__(self, source: Path):
        super().__init__(source, lambda lib: None)

    def find_compiler(self) -> str | None:
        return find_compiler()

    def no_compiler(self) -> str:
        return (f"{self.source.name} cannot be built against torch's headers: the C++ compiler "
                f"{os.environ.get('CXX') or 'g++'} is not on PATH (install g++, on Debian/Ubuntu apt-get install g++, "
                f"or set CXX)")

    def key(self, cc: str) -> bytes:
        return self.source.read_bytes() + torch.__version__.encode() + cc.encode()

    def command(self, cc: str, out: str) -> list[str]:
        torch_dir = Path(torch.__file__).parent
        include, libdir = torch_dir / "include", torch_dir / "lib"
        return [cc, "-shared", "-fPIC", "-O1", "-std=c++17",
                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}", f"-I{include}", str(self.source),
                f"-L{libdir}", "-lc10", f"-Wl,-rpath,{libdir}", "-o", out]

    def check_buildable(self) -> None:
        include = Path(torch.__file__).parent / "include"
        if not (include / "c10" / "core" / "impl" / "FakeGuardImpl.h").is_file():
            raise native.Unavailable(f"{self.source.name} cannot be built: torch {torch.__version__} has no C++ "
                                     f"headers under {include} (c10/core/impl/FakeGuardImpl.h)")

    def open(self, path: str):
        torch.ops.load_library(path)
        return ctypes.CDLL(path)           # the same handle, for a caller that looks a symbol up


def build_library() -> Path:
    """The compiled guard library for this torch, building it (about 3 s) on first use, or
    rebuilding it once where the file at its name is not the library the build recorded; not
    loaded (enable() loads it). SimulatedDeviceUnavailable, one sentence, where it cannot be had."""
    try:
        return _GuardLibrary(SOURCE).build()
    except native.Unavailable as e:
        raise SimulatedDeviceUnavailable(f"{e}; {_UNAVAILABLE}") from None


def _load_library() -> None:
    try:
        _GuardLibrary(SOURCE).load()
    except native.Unavailable as e:
        raise SimulatedDeviceUnavailable(f"{e}; {_UNAVAILABLE}") from None


_UNAVAILABLE = "the simulated device cannot be set up"


# -- the backend --------------------------------------------------------------------------------------

class _BackendModule:
    """What torch asks of a device module (`torch.fakegpu`)."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 2

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        pass

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


_lock = threading.Lock()
_ready = False
_keep: list = []          # torch.library registrations live as long as these objects


def enable() -> torch.device:
    """Set up the simulated device once per process and return the simulated GPU (`GPU`).

    Raises SimulatedDeviceUnavailable when it cannot be set up here.
    """
    global _ready
    with _lock:
        if not _ready:
            name = torch._C._get_privateuse1_backend_name()
            if name != "privateuseone":
                raise SimulatedDeviceUnavailable(f"torch's PrivateUse1 backend is already registered as {name!r} in "
                                                 f"this process; the simulated device needs it")
            _load_library()
            torch.utils.rename_privateuse1_backend(BACKEND)
            torch.utils.generate_methods_for_privateuse1_backend()
            torch._register_device_module(BACKEND, _BackendModule())
            torch._C._acc.register_python_privateuseone_hook(_Hooks())
            _register_autocast()
            _register_fused_kernels()
            _ready = True
        _check_autograd()
    return torch.device(GPU)


_FUSED_LIBRARY = None


def _register_fused_kernels() -> None:
    """Keep fused ops fused on the simulated device, as on CUDA.

    A few aten ops have a backend kernel (CPU, CUDA) and also a CompositeImplicitAutograd
    decomposition that a backend without its own kernel falls back to: `silu_backward` (SwiGLU's
    backward: FLUX.2's single blocks), `mish_backward`, `native_channel_shuffle`. On the simulated
    device (PrivateUse1, no kernels) they were decomposed into five or six full-size temporaries
    (sigmoid, 1 - sigmoid, ...) that a GPU never allocates, raising the simulated peak of a FLUX.2
    klein step by about one fused projection output. Registering a PrivateUse1 kernel for each stops
    the decomposition; the op then reaches the fake mode whole and gets its meta kernel's single
    output. The kernel itself never runs on fake tensors.
    """
    global _FUSED_LIBRARY
    names = [n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")
             and torch._C._dispatch_has_kernel_for_dispatch_key(n, "CompositeImplicitAutograd")
             and torch._C._dispatch_has_kernel_for_dispatch_key(n, "CPU")]
    lib = torch.library.Library("aten", "IMPL")

    def unreachable(*_args, **_kwargs):
        raise RuntimeError("a fused op reached the simulated device outside the fake mode")

    for name in names:
        lib.impl(name, unreachable, "PrivateUse1")
    _FUSED_LIBRARY = lib      # the registrations live as long as the library object


def _check_autograd() -> None:
    """Autograd gives each device index a thread, counted once per process at the first backward
    with the devices known then: a backward before enable() leaves the simulated device none."""
    try:
        with FakeTensorMode():
            x = torch.empty(1, device=GPU, requires_grad=True)
            (x * 2).sum().backward()
    except RuntimeError as e:
        if "device_ready_queues_" not in str(e):
            raise
        raise SimulatedDeviceUnavailable(
            "autograd ran a backward in this process before the simulated device was set up, so it has no "
            "thread for it; call leantune.memory.simulated.enable() before any backward, or run the "
            "simulation in a fresh process (run_in_fresh_process)") from None


# CUDA's autocast op lists (aten/src/ATen/autocast_mode.cpp), the ops a Flux step reaches and more.
_LOWER_PRECISION = ("mm", "bmm", "addmm", "addbmm", "baddbmm", "matmul", "linear", "addmv", "mv", "einsum",
                    "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d",
                    "conv_transpose2d", "conv_transpose3d", "prelu", "chain_matmul", "linalg_multi_dot",
                    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")
_FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
         "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm",
         "nuclear_norm", "cosine_similarity", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
         "nll_loss", "binary_cross_entropy_with_logits", "dist", "cdist", "renorm", "logsumexp", "rms_norm")
_FP32_UNLESS_DTYPE = ("prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "linalg_vector_norm")
_PROMOTE = ("cat", "stack", "index_copy", "addcdiv", "addcmul", "atan2", "cross", "dot", "tensordot", "scatter_add",
            "index_put")
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_AUTOCAST_KEY = "AutocastPrivateUse1"


def _cast_tree(tree, dtype):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype in _CASTABLE and x.dtype != dtype:
            return x.to(dtype)
        return x

    return torch.utils._pytree.tree_map(cast, tree)


# torch's autocast cache, as CUDA's autocast keeps it (aten/src/ATen/autocast_mode.cpp, cached_cast):
# a cast to the lower precision of an fp32 leaf that requires grad (a trained weight; not a view)
# is kept, while cache_enabled, until the outermost autocast exits (torch.clear_autocast_cache).
# For a full fine-tune with fp32 weights that is a bf16 copy of every trained weight for the whole
# forward, streamed ones included: the simulated device must hold it too, or its peak is low.
_cast_cache: dict[int, tuple[object, torch.Tensor]] = {}


def _cache_eligible(x: torch.Tensor, dtype: torch.dtype) -> bool:
    return (torch.is_autocast_cache_enabled() and dtype == torch.get_autocast_dtype(BACKEND)
            and x.dtype == torch.float32 and x.requires_grad and x.is_leaf and not x._is_view()
            and x.device.type == BACKEND)


def _cached_cast_tree(tree, dtype):
    def cast(x):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype in _CASTABLE and x.dtype != dtype):
            return x
        if not _cache_eligible(x, dtype):
            return x.to(dtype)
        hit = _cast_cache.get(id(x))
        if hit is not None and hit[0]() is x:
            return hit[1]
        out = x.to(dtype)
        _cast_cache[id(x)] = (weakref.ref(x), out)
        return out

    return torch.utils._pytree.tree_map(cast, tree)


def _clear_cast_cache(real_clear):
    def clear():
        _cast_cache.clear()
        return real_clear()
    return clear


def _below_autocast(op, args, kwargs):
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)):
        return op(*args, **kwargs)


def _register_autocast() -> None:
    """bf16/fp16 autocast on the simulated device with CUDA's op lists: a fallthrough for every op,
    then kernels that cast the inputs of the listed ops (lower precision, fp32, widest type)."""
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(torch.library.fallthrough_kernel, dispatch_key=_AUTOCAST_KEY)
    _keep.append(lib)
    aten = torch.library.Library("aten", "IMPL")
    _keep.append(aten)

    def lower(op):
        def kernel(*args, **kwargs):
            dtype = torch.get_autocast_dtype(BACKEND)
            return _below_autocast(op, *_cached_cast_tree((args, kwargs), dtype))
        return kernel

    torch.clear_autocast_cache = _clear_cast_cache(torch.clear_autocast_cache)

    def fp32(op):
        def kernel(*args, **kwargs):
            return _below_autocast(op, *_cast_tree((args, kwargs), torch.float32))
        return kernel

    def fp32_unless_dtype(op):
        def kernel(*args, **kwargs):
            if kwargs.get("dtype") is not None:
                return _below_autocast(op, args, kwargs)
            return _below_autocast(op, *_cast_tree((args, kwargs), torch.float32))
        return kernel

    def promote(op):
        def kernel(*args, **kwargs):
            floats = [t.dtype for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype in _CASTABLE]
            if not floats:
                return _below_autocast(op, args, kwargs)
            widest = floats[0]
            for d in floats[1:]:
                widest = torch.promote_types(widest, d)
            return _below_autocast(op, *_cast_tree((args, kwargs), widest))
        return kernel

    for names, make in ((_LOWER_PRECISION, lower), (_FP32, fp32), (_FP32_UNLESS_DTYPE, fp32_unless_dtype),
                        (_PROMOTE, promote)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                schema = op._schema
                if schema.is_mutable or any(a.alias_info is not None for a in schema.returns):
                    continue
                aten.impl(f"{name}.{overload}" if overload != "default" else name, make(op), _AUTOCAST_KEY)


# -- attention as a CUDA build runs it --------------------------------------------------------------

def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA through the flash kernel's op (with a mask, the memory-efficient one's): keeps q, k, v, out
    and a logsumexp, never L x L. Grouped
    query attention (`enable_gqa`: fewer key/value heads, Qwen3's text encoders) too: CUDA's flash
    kernel reads the shared heads in place (the fake math path would build the L x L weights)."""
    if attn_mask is not None and not enable_gqa and attn_mask.dtype in (torch.bool, query.dtype):
        # A mask: CUDA's memory-efficient kernel, the mask as an additive bias broadcast over batch and
        # heads (a boolean one turned to 0 / -inf in the query's dtype, as SDPA does): q, k, v, out,
        # the logsumexp and the bias, never the L x S weights the math kernel builds and saves
        bias = attn_mask
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                ~attn_mask, float("-inf"))
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, grad, dropout_p,
                                                                      is_causal, scale=scale)[0]
    if attn_mask is not None:
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                              scale=scale)[0]


_ORIGINAL_SDPA = torch.nn.functional.scaled_dot_product_attention


@contextlib.contextmanager
def flash_attention():
    """Route `F.scaled_dot_product_attention` to the flash op for the duration. The module
    attribute is replaced (not a TorchFunctionMode), because checkpoint's recompute in backward
    runs outside any mode entered around the forward."""
    torch.nn.functional.scaled_dot_product_attention = _flash_sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = _ORIGINAL_SDPA


class DataOnHost(TorchFunctionMode):
    """`torch.tensor(data, device=...)` / `torch.as_tensor` on the simulated device: built on the CPU,
    then moved. Tensors made from Python data skip the fake mode until they exist, and the simulated
    backend has no allocator to make them in."""

    _FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in self._FROM_DATA and device is not None and torch.device(device).type == BACKEND:
            value = func(*args, **{**kwargs, "device": "cpu"})
            # A copy into a new tensor, not .to(): the fake mode would run .to() of a known value for real.
            return torch.empty(value.shape, dtype=value.dtype, device=device).copy_(value)
        return func(*args, **kwargs)


_TENSOR_DATA = torch._C.TensorBase.data       # the C++ `.data` descriptor


def _get_data(self):
    return _TENSOR_DATA.__get__(self)


def _set_data(self, value):
    _TENSOR_DATA.__set__(self, value)
    if isinstance(value, FakeTensor):
        self.fake_device = value.fake_device


@contextlib.contextmanager
def data_moves_device():
    """Make `param.data = t` move a fake parameter to t's device, as it does for a real one.

    A FakeTensor reports the device it was made on (a Python attribute), and the C++ `.data`
    setter swaps everything but that attribute; the engine re-points weights between host buffers
    and device slots with exactly this setter.
    """
    FakeTensor.data = property(_get_data, _set_data)
    try:
        yield
    finally:
        del FakeTensor.data


@contextlib.contextmanager
def foreach_as_on_cuda():
    """Let optimizers and gradient clipping pick their multi-tensor (foreach) kernels for fake
    tensors, as they do for CUDA tensors: those allocate per step for all parameters at once, which
    is part of the peak. (torch offers foreach only to plain Tensor and Parameter types.)"""
    import torch.optim.optimizer as optimizer
    import torch.utils._foreach_utils as foreach_utils

    lists = [optimizer._foreach_supported_types, foreach_utils._foreach_supported_types]
    added = [lst for lst in lists if FakeTensor not in lst]
    for lst in added:
        lst.append(FakeTensor)
    try:
        yield
    finally:
        for lst in added:
            lst.remove(FakeTensor)


_GENERATOR = torch.Generator            # torch._C.Generator


class _GeneratorType(type(_GENERATOR)):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _GENERATOR)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, _GENERATOR)


class _Generator(_GENERATOR, metaclass=_GeneratorType):
    """`torch.Generator(device=...)` as a CUDA build answers it, for the simulated device: a
    generator whose state lives on the host (a CUDA generator's state is host memory too). The
    backend has no generator of its own (torch asks a C++ PrivateUse1 hook for one), and a random
    op on fake tensors draws nothing whatever generator it gets, so a CPU generator stands in; the
    drawn tensor is made, and counted, on the device the op names. Other devices get their own."""

    def __new__(cls, device="cpu"):
        d = torch.device(device)
        return _GENERATOR.__new__(_GENERATOR, "cpu" if d.type == BACKEND else d)


@contextlib.contextmanager
def generators_on_host():
    """`torch.Generator(device=GPU)` works for the duration (see _Generator): stochastic rounding
    (train/fused_optim.py) draws its noise with a generator per device."""
    torch.Generator = _Generator
    try:
        yield
    finally:
        torch.Generator = _GENERATOR


_STANDS_FOR: "weakref.WeakKeyDictionary" = None       # a fake tensor -> the real values it stands for


def stands_for(fake: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Mark `fake` as standing for the real host tensor `values` (same shape; an expanded view
    costs nothing) and return it. For inputs whose values decide a layout rather than a result:
    a cached caption's rows, whose zero rows are a family's image slots (Qwen-Image-2.1), which
    the step reads to lay out its sequence. Fake tensors have no values, so without this such a
    batch would read as having no slots. Kept as long as `fake` lives; read with `values_of`."""
    global _STANDS_FOR
    if tuple(values.shape) != tuple(fake.shape):
        raise ValueError(f"stands_for: values of shape {tuple(values.shape)} for a tensor of shape {tuple(fake.shape)}")
    if _STANDS_FOR is None:
        from torch.utils.weak import WeakIdKeyDictionary

        _STANDS_FOR = WeakIdKeyDictionary()
    _STANDS_FOR[fake] = values
    return fake


def values_of(t: torch.Tensor) -> torch.Tensor | None:
    """The real values a fake tensor stands for (`stands_for`), or None."""
    return None if _STANDS_FOR is None else _STANDS_FOR.get(t)


@contextlib.contextmanager
def simulation(tracker: DeviceMemoryTracker | None = None):
    """Everything inside runs on fake tensors with the simulated device set up: the fake mode,
    `tracker` (if given) counting bytes, tensors from Python data built on the host, `.data`
    moving devices, attention through the flash kernel, and generators for the simulated device.
    Yields the FakeTensorMode."""
    enable()
    with contextlib.ExitStack() as stack:
        fake = stack.enter_context(FakeTensorMode())
        if tracker is not None:
            stack.enter_context(tracker)
        stack.enter_context(DataOnHost())
        stack.enter_context(data_moves_device())
        stack.enter_context(foreach_as_on_cuda())
        stack.enter_context(flash_attention())
        stack.enter_context(generators_on_host())
        yield fake


# -- counting bytes -------------------------------------------------------------------------------------

class DeviceMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages per device, as an allocator without rounding sees
    them: an op's output storage counts when it is new (views and in-place results are not), and
    stops counting when the storage object dies.

    Only storages created while the tracker is active are counted; enter it before anything is
    placed on the simulated device.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._sizes: dict[int, tuple[str, int]] = {}
        self._lock = threading.Lock()        # storages may die on autograd's device thread

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in seen and key not in self._sizes:
                    seen.add(key)
                    self._add(key, str(t.device), storage.nbytes())
                    weakref.finalize(storage, self._release, key)
        return out

    def _add(self, key: int, device: str, n: int) -> None:
        with self._lock:
            self._sizes[key] = (device, n)
            live = self.live[device] = self.live.get(device, 0) + n
            if live > self.peak.get(device, 0):
                self.peak[device] = live

    def _release(self, key: int) -> None:
        with self._lock:
            device, n = self._sizes.pop(key, (None, 0))
            if device is not None:
                self.live[device] -= n

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (torch.cuda.reset_peak_memory_stats)."""
        with self._lock:
            self.peak = dict(self.live)
