"""Move a model's training state to host memory between phases and back (colocated generation).

Generation and training share the GPUs. While the rollout engine generates, the training state
that generation never reads (optimizer moments and fp32 main parameters, megatron DDP's
contiguous gradient buffers, optionally the parameters themselves, e.g. for the reference model)
goes to host memory, and comes back before the next forward/backward.

How: per *storage*, not per tensor. Megatron's parameters and `main_grad`s are views into a few
large contiguous buffers, and the distributed optimizer holds further views into them; moving a
tensor with `p.data = p.data.cpu()` would cut those aliases. Instead each underlying storage is
copied into a host buffer and then resized to zero bytes (its device memory goes back to the
allocator); onload resizes it back and copies the bytes in. Every view keeps pointing at the same
storage object, so nothing in megatron or the optimizer needs re-wiring. (Megatron's own
`offload_grad_buffers` frees grad buffers the same way.) Host buffers are kept and reused across
offload cycles and are pinned when CUDA is present, so repeated copies run at full bandwidth.

While offloaded, none of the offloaded tensors may be read or written: their storages are empty.

On a machine without CUDA the "device" is the CPU: the same copy-and-free happens between two CPU
buffers, which is what the CPU tests exercise (values and aliasing survive, training continues).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import torch

from verl_mcore.engine import optim_step
from verl_mcore.utils.device import cuda_in_use

KINDS = ("params", "grads", "optimizer")


@dataclasses.dataclass
class OffloadReport:
    """What one offload or onload moved.

    bytes: per kind ("params", "grads", "optimizer"), bytes of device memory freed (offload) or
    re-allocated (onload). cuda_allocated_before/after: torch.cuda.memory_allocated() around the
    call (None without CUDA): the figure to quote for "what remains during generation".
    """

    bytes: dict[str, int]
    cuda_allocated_before: int | None = None
    cuda_allocated_after: int | None = None

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


@dataclasses.dataclass
class _Entry:
    kind: str
    storage: torch.UntypedStorage
    nbytes: int
    keep_values: bool  # False: a grad buffer whose contents are dropped (zeros after onload)


def cuda_memory_allocated() -> int | None:
    """torch.cuda.memory_allocated() of the current device, None without CUDA."""
    return torch.cuda.memory_allocated() if cuda_in_use() else None


class HostOffloader:
    """Offloads and onloads the training state of one model (its chunks and optimizer).

    model_chunks: megatron DDP-wrapped chunks (their grad buffers can move) or bare modules.
    optimizer: a megatron optimizer (distributed or not, possibly chained), a torch optimizer,
        or None.

        offloader = HostOffloader(engine.model, engine.optimizer)
        report = offloader.offload()      # before generation; report.total_bytes freed
        ...generate...
        offloader.onload()                # before the next forward/backward

    params: also move the model parameters (megatron's param buffer when the distributed
        optimizer is on, else each parameter's storage). The reference model uses this with
        optimizer=None.
    grads: move DDP's contiguous grad buffers (`buffer.grad_data` of every chunk).
    keep_grads: copy the gradient values out and back. Off by default: between phases the
        buffers hold nothing the next step reads (it zeroes them first), so they are only freed
        and come back as zeros, which saves two copies of 4 bytes per parameter.
    frozen: the selected tensors are never written while on the device (the reference model's
        weights), so the host copy made by the first offload stays current: later offloads only
        free the device memory, and each cycle costs one host-to-device copy.
    optimizer_state: move the optimizer's state tensors (Adam moments, step) and its own copies
        of the parameters (fp32 main parameters of a bf16 model). Parameters the optimizer shares
        with the model (fp32 training) count as "params", not as optimizer state.
    """

    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module],
        optimizer: Any = None,
        *,
        params: bool = False,
        grads: bool = True,
        keep_grads: bool = False,
        optimizer_state: bool = True,
        empty_cache: bool = True,
        frozen: bool = False,
    ):
        self.model_chunks = list(model_chunks)
        self.optimizer = optimizer
        self.params = params
        self.grads = grads
        self.keep_grads = keep_grads
        self.optimizer_state = optimizer_state
        self.empty_cache = empty_cache
        self.frozen = frozen
        self._entries: list[_Entry] | None = None  # set while offloaded
        self._host: dict[int, torch.Tensor] = {}  # storage id -> reusable host byte buffer
        self._on_cuda = cuda_in_use()

    @property
    def offloaded(self) -> bool:
        return self._entries is not None

    def offload(self) -> OffloadReport:
        """Copy the selected state to host memory and free its device memory."""
        if self._entries is not None:
            raise RuntimeError("HostOffloader.offload: already offloaded (call onload() first)")
        before = cuda_memory_allocated()
        entries = self._collect()
        for entry in entries:
            if entry.keep_values and not (self.frozen and id(entry.storage) in self._host):
                host = self._host_buffer(entry)
                host.copy_(_byte_view(entry.storage, entry.nbytes), non_blocking=self._on_cuda)
        if self._on_cuda:
            torch.cuda.synchronize()  # the copies must land before the memory is handed back
        for entry in entries:
            entry.storage.resize_(0)
        if self._on_cuda and self.empty_cache:
            torch.cuda.empty_cache()  # so a rollout engine that asks the driver sees it free
        self._entries = entries
        live = {id(e.storage) for e in entries if e.keep_values}
        # Host buffers of storages that no longer exist (e.g. a rebuilt optimizer) are dropped.
        self._host = {k: v for k, v in self._host.items() if k in live}
        return OffloadReport(_bytes_by_kind(entries), before, cuda_memory_allocated())

    def onload(self) -> OffloadReport:
        """Re-allocate the offloaded storages on the device and copy their contents back."""
        if self._entries is None:
            raise RuntimeError("HostOffloader.onload: nothing is offloaded")
        before = cuda_memory_allocated()
        entries, self._entries = self._entries, None
        for entry in entries:
            entry.storage.resize_(entry.nbytes)
            target = _byte_view(entry.storage, entry.nbytes)
            if entry.keep_values:
                target.copy_(self._host[id(entry.storage)], non_blocking=self._on_cuda)
            else:
                target.zero_()
        if self._on_cuda:
            torch.cuda.synchronize()
        return OffloadReport(_bytes_by_kind(entries), before, cuda_memory_allocated())

    # ------------------------------------------------------------------ internals

    def _collect(self) -> list[_Entry]:
        """The storages to move, each once, classified params > grads > optimizer.

        A storage reachable from two kinds belongs to the first: a grad buffer that also holds
        parameters (megatron's shared-buffer mode) must keep its values.
        """
        device_type = "cuda" if self._on_cuda else "cpu"
        seen: dict[int, _Entry] = {}
        entries: list[_Entry] = []

        def add(kind: str, tensors: Iterable[torch.Tensor], keep_values: bool, select: bool):
            for t in tensors:
                if t is None or t.device.type != device_type:
                    continue
                storage = t.untyped_storage()
                nbytes = storage.nbytes()
                if nbytes == 0:
                    continue
                key = storage.data_ptr()
                if key in seen:
                    continue
                entry = _Entry(kind, storage, nbytes, keep_values)
                # Remember storages of unselected kinds too so they are never moved as another.
                seen[key] = entry
                if select:
                    entries.append(entry)

        add("params", _model_params(self.model_chunks), True, self.params)
        add("grads", _grad_buffers(self.model_chunks), self.keep_grads, self.grads)
        if self.optimizer is not None:
            add("optimizer", _optimizer_tensors(self.optimizer), True, self.optimizer_state)
        return entries

    def _host_buffer(self, entry: _Entry) -> torch.Tensor:
        key = id(entry.storage)
        host = self._host.get(key)
        if host is None or host.numel() != entry.nbytes:
            host = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=self._on_cuda)
            self._host[key] = host
        return host


def _byte_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage [nbytes]."""
    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return view.set_(storage, 0, (nbytes,), (1,))


def _bytes_by_kind(entries: list[_Entry]) -> dict[str, int]:
    out = dict.fromkeys(KINDS, 0)
    for entry in entries:
        out[entry.kind] += entry.nbytes
    return out


def _model_params(chunks: Sequence[torch.nn.Module]) -> Iterable[torch.Tensor]:
    for chunk in chunks:
        yield from chunk.parameters()


def _grad_buffers(chunks: Sequence[torch.nn.Module]) -> Iterable[torch.Tensor]:
    """grad_data of every megatron DDP buffer (dense and expert-parallel) of every chunk."""
    for chunk in chunks:
        for attr in ("buffers", "expert_parallel_buffers"):
            # On DDP these are lists of _ParamAndGradBuffer; on a bare nn.Module `buffers` is
            # the method (no grad buffers: e.g. the reference model).
            buffers = getattr(chunk, attr, None)
            if isinstance(buffers, list):
                for buffer in buffers:
                    yield buffer.grad_data


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (possibly chained), or the optimizer
    itself when it is a plain torch one."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    out = []
    for opt in optim_step.sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and not getattr(opt, "is_stub_optimizer", False):
            out.append(inner)  # (a stub: a rank with no parameters of this kind)
    return out


def _optimizer_tensors(optimizer: Any) -> Iterable[torch.Tensor]:
    """Tensors the torch optimizer(s) own: the params it updates and every state tensor."""
    for inner in _torch_optimizers(optimizer):
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value
