"""Run megatron-core on CPU ranks under gloo (the test suite and CPU development machines).

megatron-core 0.16.1 assumes CUDA in a few dozen places that have nothing to do with the model
math: buffers created with `device="cuda"` or `device=torch.cuda.current_device()`, `.cuda()`
calls, dtype checks that compare `tensor.type()` with `"torch.cuda.FloatTensor"`, and an RNG
tracker that reads and writes the CUDA generator. `install()` redirects exactly those to the CPU so
that the real megatron code paths (GPTModel, tensor/pipeline parallel layers, the pipeline
schedules, DDP and the distributed optimizer) run unchanged on gloo.

    from verl_mcore.distributed import cpu_compat
    cpu_compat.install()        # before building models; a no-op when CUDA is available
    cpu_compat.install("cpu")   # trainer.device=cpu: also under a CUDA build of torch

What `install()` changes, process-wide (see PATCHES for the exact targets):

1. A TorchFunctionMode that rewrites CUDA devices to CPU in every torch call that takes a device
   (`torch.zeros(..., device="cuda")`, `x.to(torch.cuda.current_device())`, `x.cuda()`) and drops
   pinned memory (`pin_memory=True`, `x.pin_memory()` -> a plain copy). Only in the thread that
   called install() (the main thread of a rank), and re-entered by megatron's parallel-linear
   backward, which autograd runs with an empty mode stack.
2. `torch.cuda.current_device()` returns 0 instead of raising, so the ~50 call sites that pass it
   as a device (then rewritten by 1) work; `torch.cuda.synchronize()` does nothing.
3. The RNG tracker (`megatron.core.tensor_parallel.random`) keeps CPU generator states: on CPU
   the generator that dropout and init draw from *is* the CPU default generator.
4. `tensor.type()` reports CPU tensors as `torch.cuda.*Tensor` inside the few megatron functions
   that reject anything else (distributed optimizer set-up, fp32 gradient clipping).

Everything is active only on a process that computes on the CPU: `install()` ("auto") does
nothing where torch sees a GPU, so production runs never go through this module; `install("cpu")`
(trainer.device=cpu, which distributed/launch.py passes) installs under a CUDA build of torch as
well. That case needs the patches as much as a CPU build does: without them megatron allocates its
parameter and gradient buffers on `torch.cuda.current_device()`, and under gloo the distributed
optimizer's parameter all-gather (param_and_grad_buffer.py `start_param_sync`, inside
torch.distributed's `_coalescing_manager`) reaches gloo's coalesced all-gather, which has no CUDA
variant: it hands the CUDA tensors' device pointers to gloo as host memory and the process
segfaults (seen with torch 2.11+cu130). Installing also records the CPU as this process's compute
device (utils/device.py), which our own CUDA-or-CPU branches read.

Every patched megatron target is listed in PATCHES with the signature it was written against;
tests/distributed/test_cpu_compat.py fails when an upgrade of megatron-core moves or changes one
of them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from verl_mcore.utils.device import set_compute_device

MEGATRON_CORE_VERSION = "0.16.1"  # the version these patches were written and tested against

_CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Patch:
    """One megatron-core (or torch.cuda) attribute that install() replaces.

    `params` is the parameter list the replacement was written against; the tests compare it
    with the installed version so an upgrade that changes the target fails loudly.
    """

    module: str
    attr: str  # "Class.method" or "function"
    params: tuple[str, ...]
    why: str


PATCHES: tuple[Patch, ...] = (
    Patch(
        "torch.cuda",
        "current_device",
        (),
        "megatron passes torch.cuda.current_device() as `device=` in ~50 places (tensor_parallel/"
        "layers.py, mappings.py, p2p_communication.py, distrib_optimizer.py, rotary embeddings, "
        "...); on a CPU build it raises. Returning 0 lets the device mode map it to CPU.",
    ),
    Patch(
        "torch.cuda",
        "synchronize",
        ("device",),
        "pipeline_parallel/p2p_communication.py _communicate (batch_p2p_sync, on by default) and "
        "DistributedDataParallel offload/reload call it; it raises on a CPU build. CPU ops are "
        "synchronous and the gloo requests are waited on, so there is nothing to wait for.",
    ),
    Patch(
        "torch.cuda",
        "Stream",
        ("device", "priority", "kwargs"),
        "The MoE all-to-all dispatcher (transformer/moe/token_dispatcher.py) creates a side "
        "stream in __init__ for its device-to-host copies of the split sizes; a CPU build cannot "
        "create one. On CPU: a stream whose waits and events do nothing (CPU ops are synchronous).",
    ),
    Patch(
        "megatron.core.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
        ("self", "point", "tokens_per_expert"),
        "Copies the split sizes to the host on that side stream (torch.cuda.current_stream / "
        "torch.cuda.stream, which raise on a CPU build) and turns them into numpy arrays, which "
        "the all-to-all then takes as split lists. On CPU the tensors are already on the host: "
        "only the numpy conversion is kept, at the same point of the dispatch.",
    ),
    Patch(
        "megatron.core.tensor_parallel.random",
        "_get_cuda_rng_state",
        ("device", "clone", "graph_safe"),
        "Used by CudaRNGStatesTracker.fork, activation checkpointing (_get_all_rng_states) and "
        "convert_cuda_rng_state; reads the CUDA generator. On CPU: the default CPU generator.",
    ),
    Patch(
        "megatron.core.tensor_parallel.random",
        "_set_cuda_rng_state",
        ("new_state", "device", "graph_safe"),
        "Counterpart of _get_cuda_rng_state (queues a CUDA generator write with _lazy_call, which "
        "a CPU build never runs). On CPU: sets the default CPU generator.",
    ),
    Patch(
        "megatron.core.tensor_parallel.random",
        "CudaRNGStatesTracker.add",
        ("self", "name", "seed"),
        "Calls torch.cuda.get_rng_state()/torch.cuda.manual_seed() directly (raises on a CPU "
        "build; called by model_parallel_cuda_manual_seed). On CPU: a CPU generator state per seed.",
    ),
    Patch(
        "megatron.core.tensor_parallel.random",
        "CudaRNGStatesTracker.fork",
        ("self", "name"),
        "Swaps the CUDA generator and warns when the CPU generator changed inside the fork; on CPU "
        "the forked generator *is* the CPU one, so that warning would fire on every dropout.",
    ),
    Patch(
        "megatron.core.tensor_parallel.layers",
        "LinearWithGradAccumulationAndAsyncCommunication.backward",
        ("ctx", "grad_output"),
        "Allocates with device=torch.cuda.current_device() (the placeholder weight gradient of "
        "gradient_accumulation_fusion, the sequence-parallel reduce-scatter output), and autograd "
        "runs backward functions without the torch-function mode stack, so the device mode does "
        "not reach it. On CPU: the original backward inside the device mode.",
    ),
    Patch(
        "megatron.core.tensor_parallel.mappings",
        "_AllToAll.backward",
        ("ctx", "grad_output"),
        "The MoE all-to-all dispatcher's backward is another all-to-all, whose output buffer is "
        "allocated with device=torch.cuda.current_device(); autograd runs it without the device "
        "mode. On CPU: the original backward inside the device mode.",
    ),
    Patch(
        "megatron.core.tensor_parallel.mappings",
        "_GatherFromSequenceParallelRegion.backward",
        ("ctx", "grad_output"),
        "The MoE dispatcher gathers tokens over the expert-TP group (and sequence parallelism "
        "over TP); the backward reduce-scatters into a buffer on torch.cuda.current_device(). "
        "On CPU: the original backward inside the device mode.",
    ),
    Patch(
        "megatron.core.tensor_parallel.mappings",
        "_ReduceScatterToSequenceParallelRegion.backward",
        ("ctx", "grad_output"),
        "Counterpart of the gather above (the dispatcher's combine over the expert-TP group): "
        "its backward all-gathers into a buffer on torch.cuda.current_device(). On CPU: the "
        "original backward inside the device mode.",
    ),
    Patch(
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer.__init__",
        (
            "self", "optimizer", "config", "grad_scaler", "init_state_fn", "model_chunks",
            "per_model_buffers", "data_parallel_group", "data_parallel_group_gloo",
            "data_parallel_group_idx", "distributed_optimizer_instance_id",
        ),
        "_build_model_and_main_param_groups raises unless param.type() is one of "
        "'torch.cuda.{Float,Half,BFloat16}Tensor', and __init__ tests the same strings to decide "
        "which params get fp32 main copies.",
    ),
    Patch(
        "megatron.core.optimizer.clip_grads",
        "clip_grad_by_total_norm_fp32",
        ("parameters", "max_norm", "total_norm", "use_decoupled_grad"),
        "Asserts param.grad.type() == 'torch.cuda.FloatTensor'. Also re-bound in "
        "megatron.core.optimizer.optimizer, which imported it by name.",
    ),
)

# Modules that imported a patched function by name and need the wrapped one too.
_REBOUND_IN = {
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"): (
        "megatron.core.optimizer.optimizer",
    ),
}

_installed = False
_device_mode: TorchFunctionMode | None = None


# ---------------------------------------------------------------- 1. device rewriting


def _is_cuda_device(device: Any) -> bool:
    """True for anything torch would read as a CUDA device: "cuda", "cuda:1", torch.device("cuda"),
    or a bare int (an int device index always means CUDA)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU in torch calls.

    Covers the factory calls with `device="cuda"` (optimizer/optimizer.py found_inf and scale
    tensors, clip_grads.py, grad_scaler.py, pipeline_parallel/schedules.py total_num_tokens,
    transformer/utils.py get_default_causal_mask, distributed/param_and_grad_buffer.py, ...),
    `device=torch.cuda.current_device()` (tensor_parallel/mappings.py gathers, p2p_communication.py
    receive buffers, distrib_optimizer.py, GPTModel, attention), `Tensor.to(<cuda>)`
    (rotary_pos_embedding.py, transformer_layer.py) and `Tensor.cuda()` (grad_scaler.py
    load_state_dict, optimizer.py state reload, language_module.py); and pinned memory, which
    a CPU-only build cannot allocate (`pin_memory=True`, `Tensor.pin_memory()`).

    Torch function modes are per thread: this covers the thread that called install(), which is
    where megatron runs (on CPU, autograd runs backward in the calling thread too, but calls
    backward functions with an empty mode stack: the one megatron backward that allocates on
    "the current device" is patched to enter this mode itself, see PATCHES).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if kwargs.get("pin_memory"):
            # Pinned host memory needs an accelerator; it only speeds up host<->device copies.
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.cuda:
            # x.cuda(device=None, non_blocking=False, memory_format=...) -> stays on CPU.
            return args[0]
        if func is torch.Tensor.pin_memory:
            # A copy, as pin_memory() of an unpinned tensor is. ParamAndGradBuffer.offload_to_cpu
            # (distributed/param_and_grad_buffer.py) keeps `param_data.cpu().pin_memory()` and
            # then frees param_data's storage: on CPU `.cpu()` is the same tensor, so only this
            # copy keeps the parameters alive.
            return args[0].clone()
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _synchronize(device: Any = None) -> None:
    """Stand-in for torch.cuda.synchronize() on CPU: nothing is asynchronous."""


def _current_device() -> int:
    """Stand-in for torch.cuda.current_device() on CPU: index 0, read as CPU by _CpuDeviceMode."""
    return 0


class _HostStream:
    """torch.cuda.Stream on CPU: every operation is already complete when it returns, so waiting
    on, recording or synchronising a stream has nothing to do."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_HostStream":
        return self  # an "event" whose synchronize() returns at once

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _dispatcher_splits_to_host(self, point: str, tokens_per_expert: Any = None) -> Any:
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize on CPU: at the point where the GPU
    path copies the split sizes to the host, turn them into the numpy arrays that path hands the
    all-to-all (maybe_move_tensor_to_cpu(..., as_numpy=True)); there is no stream to sync."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for attr in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, attr, None)
            if torch.is_tensor(value):
                setattr(self, attr, value.numpy())
    return tokens_per_expert


# ---------------------------------------------------------------- 3. RNG tracker on the CPU generator


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    """random._get_cuda_rng_state on CPU: the state of the default CPU generator."""
    if graph_safe:
        raise RuntimeError(
            "cpu_compat: graph-safe (CUDA graph) RNG states do not exist on CPU; "
            "set use_cudagraphable_rng=False / cuda_graph_impl='none' in the TransformerConfig"
        )
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """random._set_cuda_rng_state on CPU: set the default CPU generator."""
    if graph_safe:
        raise RuntimeError("cpu_compat: graph-safe (CUDA graph) RNG states do not exist on CPU")
    torch.set_rng_state(new_state)


def _tracker_add(self, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add on CPU: same bookkeeping, state of a CPU generator seeded `seed`.

    The default CPU generator is left untouched, as megatron leaves the default CUDA one.
    """
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    self.states_[name] = generator.get_state()


@contextlib.contextmanager
def _tracker_fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
    """CudaRNGStatesTracker.fork on CPU: run the body with the default CPU generator set to the
    tracked state `name`, store the advanced state back, and restore the caller's state.

    Nesting follows megatron's version: the state of an enclosing fork is saved under its name.
    """
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    orig_state = torch.get_rng_state()
    orig_name = self._current_state_name
    if orig_name != "default-rng":
        self.states_[orig_name] = orig_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        if self._current_state_name != name:
            raise Exception(
                f"current state name {self._current_state_name} is not the same as the desired "
                f"state name {name}."
            )
        self.states_[name] = torch.get_rng_state()
        if orig_name != "default-rng":
            orig_state = self.states_[orig_name]
        torch.set_rng_state(orig_state)
        self._current_state_name = orig_name


# ---------------------------------------------------------------- 4. CUDA tensor type names


class _CudaTypeNameMode(TorchFunctionMode):
    """Makes `tensor.type()` (no arguments) of a CPU tensor answer "torch.cuda.FloatTensor" etc.

    Only entered around the megatron functions listed in PATCHES that compare type strings.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            if isinstance(result, str) and result.startswith("torch.") and args[0].is_cpu:
                return "torch.cuda." + result[len("torch."):]
        return result


def _backward_in_device_mode(original: staticmethod) -> staticmethod:
    """A torch.autograd.Function's static backward, run inside the CPU device mode (autograd
    calls backward functions with an empty torch-function mode stack)."""
    fn = original.__func__

    @functools.wraps(fn)
    def backward(*args, **kwargs):
        with _CpuDeviceMode():
            return fn(*args, **kwargs)

    backward.__cpu_compat_wrapped__ = fn
    return staticmethod(backward)


def _with_cuda_type_names(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CudaTypeNameMode():
            return fn(*args, **kwargs)

    wrapper.__cpu_compat_wrapped__ = fn
    return wrapper


# ---------------------------------------------------------------- install


def resolve(patch: Patch) -> tuple[Any, str, Any]:
    """(owner object, attribute name, current value) for a Patch; raises naming what is missing."""
    module = importlib.import_module(patch.module)
    owner: Any = module
    *path, leaf = patch.attr.split(".")
    for part in path:
        if not hasattr(owner, part):
            raise AttributeError(f"cpu_compat: {patch.module}.{part} not found (patch {patch.attr})")
        owner = getattr(owner, part)
    if leaf not in vars(owner):
        raise AttributeError(f"cpu_compat: {patch.module}.{patch.attr} not found")
    return owner, leaf, vars(owner)[leaf]


def _replacements() -> dict[tuple[str, str], Callable[[Any], Any]]:
    """(module, attr) -> function that builds the replacement from the original."""
    return {
        ("torch.cuda", "current_device"): lambda orig: _current_device,
        ("torch.cuda", "synchronize"): lambda orig: _synchronize,
        ("torch.cuda", "Stream"): lambda orig: _HostStream,
        ("megatron.core.transformer.moe.token_dispatcher",
         "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize"):
            lambda orig: _dispatcher_splits_to_host,
        ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): lambda orig: _get_cpu_rng_state,
        ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): lambda orig: _set_cpu_rng_state,
        ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add"): lambda orig: _tracker_add,
        ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork"): lambda orig: _tracker_fork,
        ("megatron.core.tensor_parallel.layers",
         "LinearWithGradAccumulationAndAsyncCommunication.backward"): _backward_in_device_mode,
        ("megatron.core.tensor_parallel.mappings", "_AllToAll.backward"): _backward_in_device_mode,
        ("megatron.core.tensor_parallel.mappings",
         "_GatherFromSequenceParallelRegion.backward"): _backward_in_device_mode,
        ("megatron.core.tensor_parallel.mappings",
         "_ReduceScatterToSequenceParallelRegion.backward"): _backward_in_device_mode,
        ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"): _with_cuda_type_names,
        ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"): _with_cuda_type_names,
    }


def is_installed() -> bool:
    return _installed


def install(device: str = "auto") -> bool:
    """Make megatron-core run on CPU in this process. Returns True when the patches are active.

    device: "auto" installs only where torch sees no GPU; "cpu" installs whatever torch sees (the
    process computes on the CPU though CUDA is there: trainer.device=cpu); "cuda" does nothing.
    Idempotent. Call it in every rank before megatron builds models or optimizers (a spawned rank
    starts without it): patches installed after a model was built on the GPU cannot move it.
    """
    global _installed, _device_mode
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"cpu_compat.install: device {device!r} is not one of auto, cpu, cuda")
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return False
    if _installed:
        return True
    set_compute_device("cpu")
    import megatron.core

    if megatron.core.__version__ != MEGATRON_CORE_VERSION:
        # Not fatal: the signature checks in the tests are the real guard. Say it once, loudly.
        import warnings

        warnings.warn(
            f"cpu_compat was written for megatron-core {MEGATRON_CORE_VERSION}, found "
            f"{megatron.core.__version__}; run tests/distributed/test_cpu_compat.py",
            stacklevel=2,
        )
    builders = _replacements()
    resolved = [(p, *resolve(p)) for p in PATCHES]  # resolve all first: all-or-nothing
    for patch, owner, leaf, original in resolved:
        replacement = builders[(patch.module, patch.attr)](original)
        setattr(owner, leaf, replacement)
        for name in _REBOUND_IN.get((patch.module, patch.attr), ()):
            setattr(importlib.import_module(name), leaf, replacement)
    _device_mode = _CpuDeviceMode()
    _device_mode.__enter__()  # stays on the mode stack for the life of the process
    _installed = True
    return True
