"""Block swap: keep the frozen weights of N transformer blocks in CPU memory and bring each block onto the
accelerator only while it runs, forward and (with gradient checkpointing) in the backward pass's recomputation.

Why our own module and not accelerate's or diffusers' offloading hooks: both are made for inference. accelerate's
``cpu_offload`` hooks copy synchronously on the compute stream, one module at a time, and swap ``param.data`` in
place, so autograd, which saved the Parameter object itself, finds the CPU (or meta) tensor in the backward pass.
diffusers' group offloading prefetches on a side stream, but in the order of the first forward pass, which is the
wrong way round during the backward recomputation, and it also swaps ``param.data`` in place. Training needs
three things they do not give together: the trainable LoRA tensors stay on the device (the optimizer and its
moments hold them), the backward pass's recomputation brings each block in again in reverse order, and a
weight that autograd saved stays valid until its node has run.

How: a block that is "in" has fresh Parameter objects (and buffers) on the device; one that is "out" has empty
placeholders of the right dtype (so any use of a block that is out fails loudly instead of computing with
garbage, on the CPU too, where both sides are the same memory). Bringing a block in puts *new* Parameter objects
into its modules rather than changing ``.data`` of the old ones, and sending it back puts placeholders there: a
tensor autograd saved during the recomputation keeps its device memory alive until its backward node has run, and
no longer. With gradient checkpointing the first forward saves no weights at all (torch's non-reentrant
checkpoint keeps only holders), so at most the running block and the one being prefetched are on the device (in
the backward pass, also the one whose backward node is finishing).
Without gradient checkpointing autograd would keep every block's weights until the backward pass, so swap
requires it (config/families.py says so before any model loads).

On a CUDA device the next block is copied on a side stream while the current one computes (from pinned memory,
non-blocking); the direction is the forward order in a forward pass and the reverse order inside the backward
pass (torch's own checkpoint tells the two apart the same way: ``torch._C._current_graph_task_id``). On the CPU
the copies are synchronous and free; the counters (``brought_in``, ``sent_back``) are what tests look at.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

CPU = torch.device("cpu")


def in_backward_pass() -> bool:
    """True inside autograd's backward pass (where checkpointed blocks are recomputed), as torch's checkpoint tells."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


@dataclass
class _Frozen:
    """One frozen tensor of a swapped block: where it lives (`module`, `name`, parameter or buffer) and its home
    copy in CPU memory (pinned when the device is CUDA)."""

    module: torch.nn.Module
    name: str
    is_parameter: bool
    home: torch.Tensor
    follows_dtype: bool  # a recast of the model (the fp16 fallback) recasts it; quantised codes and scales do not

    def wanted(self) -> torch.dtype:
        """The dtype the model wants it in now: its placeholder's, which a recast of the model recast."""
        return self.current().dtype if self.follows_dtype else self.home.dtype

    def copy_to(self, device: torch.device) -> torch.Tensor:
        copy = self.home.to(device, non_blocking=True)
        return copy.to(self.wanted()) if copy.dtype != self.wanted() else copy

    def install(self, tensor: torch.Tensor) -> None:
        if self.is_parameter:
            self.module._parameters[self.name] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            self.module._buffers[self.name] = tensor

    def current(self) -> torch.Tensor:
        return self.module._parameters[self.name] if self.is_parameter else self.module._buffers[self.name]


@dataclass
class _Block:
    index: int
    module: torch.nn.Module
    frozen: list[_Frozen]
    resident: bool = False
    copies: list[torch.Tensor] | None = None  # a prefetched device copy not installed yet
    ready: object = None  # the CUDA event that says the prefetch finished


@dataclass
class BlockSwap:
    """The swapped blocks of one model and their bookkeeping; `attach` builds it."""

    blocks: list[_Block]
    device: torch.device
    brought_in: dict[int, int] = field(default_factory=dict)  # block index -> times brought onto the device
    sent_back: dict[int, int] = field(default_factory=dict)
    prefetched: int = 0
    _stream: object = None
    _callback_task: int = -1
    _handles: list = field(default_factory=list)

    # ------------------------------------------------------------------ set up
    @classmethod
    def attach(cls, blocks: Sequence[torch.nn.Module], count: int, device: torch.device | str,
               dtype: torch.dtype | None = None) -> "BlockSwap":
        """Swap the last `count` of `blocks` (in execution order): their frozen parameters and buffers move to CPU
        memory (cast to `dtype` when floating, the run's weight dtype, so placing the model later casts nothing
        here) and are replaced by placeholders; trainable tensors (the LoRA) are left where they are. Call before
        the model is placed on the device, so the swapped weights never go there all at once."""
        device = torch.device(device)
        swap = cls([], device)
        if device.type == "cuda":
            swap._stream = torch.cuda.Stream(device)
        swap.extend(blocks, count, dtype)
        return swap

    def extend(self, blocks: Sequence[torch.nn.Module], count: int, dtype: torch.dtype | None = None) -> list[int]:
        """Swap the last `count` of `blocks` from now on (more than before: the out-of-memory guard's last resort);
        the blocks newly swapped leave the device one at a time, as they are stored. Returns their indices."""
        first_swapped = self.blocks[0].index if self.blocks else len(blocks)
        added = []
        for index in range(len(blocks) - count, first_swapped):
            block = self._swap_out(blocks[index], index, dtype)
            added.append(block)
            self._handles.append(block.module.register_forward_pre_hook(self._make_pre_hook(block)))
            self._handles.append(block.module.register_forward_hook(self._make_post_hook(block)))
        self.blocks[:0] = added
        return [b.index for b in added]

    def _swap_out(self, module: torch.nn.Module, index: int, dtype: torch.dtype | None) -> _Block:
        frozen = []
        for part in module.modules():
            for name, p in list(part._parameters.items()):
                if p is not None and not p.requires_grad:
                    frozen.append(_Frozen(part, name, True, _home(p.detach(), dtype, self.device),
                                          p.is_floating_point()))
            keep = getattr(part, "keeps_buffer_dtypes", False)  # quantised codes and scales stay as stored
            for name, b in list(part._buffers.items()):
                if b is not None:
                    frozen.append(_Frozen(part, name, False, _home(b, None if keep else dtype, self.device),
                                          b.is_floating_point() and not keep))
        block = _Block(index, module, frozen)
        self._send_back(block, count=False)
        return block

    def detach(self) -> None:
        """Bring every block in for good and remove the hooks (e.g. before merging the model)."""
        for handle in self._handles:
            handle.remove()
        for block in self.blocks:
            self._bring_in(block, count=False)

    # ------------------------------------------------------------------ moves
    @property
    def resident(self) -> list[int]:
        return [b.index for b in self.blocks if b.resident]

    def _bring_in(self, block: _Block, *, count: bool = True) -> None:
        if block.resident:
            return
        if block.copies is not None:  # prefetched on the side stream: wait for that copy, not for the whole stream
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(block.ready)
            copies = block.copies
            for tensor in copies:
                tensor.record_stream(stream)  # the allocator must not reuse it while the compute stream reads it
            block.copies, block.ready = None, None
        else:
            copies = [f.copy_to(self.device) for f in block.frozen]
        for f, tensor in zip(block.frozen, copies):
            f.install(tensor)
        block.resident = True
        if count:
            self.brought_in[block.index] = self.brought_in.get(block.index, 0) + 1

    def _send_back(self, block: _Block, *, count: bool = True) -> None:
        """Put placeholders in: the device copies are freed once nothing (autograd included) holds them."""
        for f in block.frozen:
            f.install(torch.empty(0, dtype=f.wanted(), device=self.device))
        block.copies, block.ready = None, None
        was_resident, block.resident = block.resident, False
        if count and was_resident:
            self.sent_back[block.index] = self.sent_back.get(block.index, 0) + 1

    def _prefetch(self, block: _Block) -> None:
        """Start copying `block` to the device on the side stream (CUDA only; a no-op elsewhere)."""
        if self._stream is None or block.resident or block.copies is not None:
            return
        for other in self.blocks:  # at most one prefetch in flight: a stale one (a pass went the other way) goes
            if other is not block:
                other.copies, other.ready = None, None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            block.copies = [f.copy_to(self.device) for f in block.frozen]
            block.ready = torch.cuda.Event()
            block.ready.record(self._stream)
        self.prefetched += 1

    # ------------------------------------------------------------------ hooks
    def _send_back_all(self) -> None:
        for block in self.blocks:
            self._send_back(block)

    def _make_pre_hook(self, block: _Block):
        def pre_hook(module, args):
            backward = in_backward_pass()
            # torch's checkpoint stops a recomputation as soon as it has the tensors the backward node needs (early
            # stop), so a block's forward hook never runs there: the block recomputed before this one goes back now
            # (autograd still holds the tensors its node needs), and the last one when the backward pass ends. In a
            # forward pass nothing else is in, unless a step died half way (out of memory) and is being retried.
            for other in self.blocks:
                if other is not block and other.resident:
                    self._send_back(other)
            if backward:
                task = torch._C._current_graph_task_id()
                if task != self._callback_task:
                    self._callback_task = task
                    torch.autograd.Variable._execution_engine.queue_callback(self._send_back_all)
            self._bring_in(block)
            position = self.blocks.index(block)
            following = position - 1 if backward else position + 1
            if 0 <= following < len(self.blocks):
                self._prefetch(self.blocks[following])
        return pre_hook

    def _make_post_hook(self, block: _Block):
        def post_hook(module, args, output):
            self._send_back(block)
        return post_hook


def _home(tensor: torch.Tensor, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """The CPU copy a swapped tensor lives in: cast to the run's weight dtype when it is floating (quantised
    storage keeps its own), pinned when it will be copied to a CUDA device."""
    home = tensor.detach().to(CPU)
    if dtype is not None and home.is_floating_point():
        home = home.to(dtype)
    if device.type == "cuda":
        home = home.pin_memory()
    return home
