"""Several processes (GPUs) training one run: who this process is, and what ranks must agree on.

Launch. `torchrun --nproc_per_node N -m leantune train my.toml`, `accelerate launch -m leantune
train my.toml` and `leantune train my.toml --gpus N` (which starts torchrun) all set the same
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); `DistContext.from_config` makes the
run's `accelerate.Accelerator` (accelerate_setup.py), which joins the process group and places the
process, and takes its rank, world size and device. Without those variables the run is one
process and every collective here is a no-op, so the trainer has one code path; the Accelerator is
released at the run's end, so tests can build several configurations in one process.

LoRA (DDP semantics over the adapter only). The frozen base is never synchronised: every rank
holds (or streams) the same weights. Each step's *global* batch is `[data] batch_size x
world_size` samples of one bucket, drawn from the same seeded order as a one-process run with that
batch size; rank r trains on its rows of it, with the noise and timesteps of exactly those rows
(every rank draws the global batch's noise and keeps its slice). Each rank weights its loss by its
share of the global batch, the LoRA gradients are summed across ranks after the last micro-batch,
and every rank takes the same optimizer step. So N processes compute the step a single process
computes with the N-times batch, up to the order of floating-point additions.

Why the gradient all-reduce is issued here and not from torch's DDP backward hooks: an
out-of-memory error on one rank must make *all* ranks re-plan and redo the step. With DDP's hooks
the healthy ranks would already be blocked inside backward's all-reduce, waiting for a rank that
is re-planning. Here every rank first votes (one tiny all-reduce) on whether its forward/backward
succeeded; only then are the gradients reduced, so a failed rank never leaves a collective
half-entered, and the healthy ones raise the same out-of-memory error and re-plan with it.

Full fine-tunes (DeepSpeed ZeRO-2, FSDP2) are configured here too (see `full_strategy`); their
parameter storage is owned by those engines, so streaming is refused with them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from .errors import CheckpointError, is_out_of_memory

log = logging.getLogger("leantune")

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class ShardedOutOfMemory(RuntimeError):
    """An out-of-memory error in a full fine-tune sharded over several processes (FSDP2, DeepSpeed):
    the run ends on every rank instead of re-planning (see `DistContext.agreed_step`)."""


class StepFailedAfterVote(RuntimeError):
    """A rank failed after every rank had agreed on the step's gradients (in their reduction, the
    clipping or the optimizer step: most likely AdamW allocating its state in step 1). The other
    ranks have stepped, or are stepping, so redoing the step on the failed rank alone would leave
    the ranks' weights different: the run ends on every rank, and the last save stays the resumable
    state. Not an out-of-memory error, so no rank's OOM guard re-plans it."""


class RankOutOfMemory(torch.OutOfMemoryError):
    """Raised on healthy ranks when another rank ran out of memory in the same step: every rank's
    OOM guard then re-plans and redoes the step together."""


@dataclass(frozen=True)
class Shard:
    """This rank's part of one global batch."""

    global_size: int    # samples in the global batch (all ranks)
    start: int          # this rank's rows of it: [start, stop)
    stop: int
    weight: float       # this rank's share of the global mean loss (0 for a stand-in row)

    @property
    def rows(self) -> slice:
        return slice(self.start, self.stop)


def split_rows(global_size: int, rank: int, world_size: int) -> Shard:
    """Contiguous, as-even-as-possible rows of a global batch for `rank`.

    A bucket's last batch of an epoch may hold fewer samples than ranks: a rank left without a row
    trains on the batch's last row with weight 0, so it still joins every collective but adds
    nothing to the gradient.
    """
    start = rank * global_size // world_size
    stop = (rank + 1) * global_size // world_size
    if stop > start:
        return Shard(global_size, start, stop, (stop - start) / global_size)
    return Shard(global_size, global_size - 1, global_size, 0.0)


def shard_of(batch) -> Shard:
    """The shard a batch carries (a one-process batch is the whole global batch)."""
    shard = getattr(batch, "shard", None)
    if shard is not None:
        return shard
    n = batch.latents.shape[0]
    return Shard(n, 0, n, 1.0)


class ShardedBatches:
    """This rank's view of the global batch order: each global batch (one bucket, `batch_size x
    world_size` samples, same on every rank) cut to this rank's rows. The position (state_dict)
    is the global one, identical on every rank."""

    def __init__(self, inner, rank: int, world_size: int):
        self.inner, self.rank, self.world_size = inner, rank, world_size
        # Cut each slot before its latents and embeddings are read, so a rank reads only its rows.
        inner.order = _SlotCutter(inner.order, self)
        self.last: Shard | None = None
        self.global_slot = None
        self._t5_lengths: dict[str, int] = {}

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.inner)
        batch.shard = self.last
        longest = self._longest_prompt()
        if longest is not None and batch.embeds.t5.shape[1] < longest:
            t5 = batch.embeds.t5
            # Flux attends to padded text tokens too: pad to the global batch's longest prompt, as
            # the one-process batch is, so each row computes exactly what it computes there.
            pad = t5.new_zeros(t5.shape[0], longest - t5.shape[1], t5.shape[2])
            batch.embeds = replace(batch.embeds, t5=torch.cat([t5, pad], dim=1))
        return batch

    def _longest_prompt(self) -> int | None:
        data, slot = getattr(self.inner, "data", None), self.global_slot
        if data is None or slot is None:
            return None
        captions = ["" if drop else data.samples[i].item.caption for i, drop in zip(slot.samples, slot.dropped)]
        for c in captions:
            if c not in self._t5_lengths:
                self._t5_lengths[c] = data.text_entry(c)[0].shape[0]
        return max(self._t5_lengths[c] for c in captions)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        self.inner.load_state_dict(state, strict=strict)


class _SlotCutter:
    """Wraps a BatchOrder: hands out this rank's rows of every global slot."""

    def __init__(self, order, owner: ShardedBatches):
        self.order, self.owner = order, owner

    def __getattr__(self, name):
        return getattr(self.order, name)

    def __iter__(self):
        return self

    def __next__(self):
        slot = next(self.order)
        shard = split_rows(len(slot.samples), self.owner.rank, self.owner.world_size)
        self.owner.last, self.owner.global_slot = shard, slot
        return replace(slot, samples=slot.samples[shard.rows], dropped=slot.dropped[shard.rows])


@dataclass
class DistContext:
    """Who this process is in the run, and the few collectives the trainer needs.

    One per run, made by `DistContext.from_config` at the start of `train()`. With `world_size`
    1 every method is a no-op or an identity, so single-process code needs no branches.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    strategy: str = "none"          # "none" (one process), "ddp", "deepspeed", "fsdp2"
    backend: str | None = None      # "gloo" / "nccl" when distributed
    owns_group: bool = False        # this context initialised the process group (and destroys it)
    accelerator: object = None      # the run's accelerate.Accelerator (None: a bare context for unit use)
    device: torch.device | None = None   # the accelerator's device for this process
    _saved_env: dict | None = None
    _host_group: object = None       # a gloo group for host tensors when the default group has no CPU backend
    _after_vote: bool = False        # this step's gradient vote passed (see `agreed_step`)
    _step: int | None = None         # the step `agreed_step` runs

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        if not self.distributed:
            return "one process"
        return (f"rank {self.rank} of {self.world_size} (local {self.local_rank} of {self.local_world_size}), "
                f"strategy {self.strategy}, backend {self.backend}")

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg, device: torch.device | None = None) -> "DistContext":
        """The run's `accelerate.Accelerator` (accelerate_setup.py) joins the process group the launcher
        described and places this process; its rank, world size and device are this context's.
        `close()` releases it, so another run in this process may configure its own."""
        from .accelerate_setup import make_accelerator

        env = launch_env()
        world = env["WORLD_SIZE"] if env is not None else 1
        strategy = resolve_strategy(cfg.distributed.strategy, cfg.train.mode) if world > 1 else "none"
        if world > 1:
            die_with_launcher()
        import torch.distributed as dist

        had_group = dist.is_available() and dist.is_initialized()
        accelerator, saved_env = make_accelerator(cfg, device or torch.device("cpu"), strategy, world)
        state = accelerator.state
        distributed = accelerator.num_processes > 1
        # accelerate names a CPU process's device "cpu:<local rank mod 1>"; CPU tensors say "cpu", and
        # the memory engine compares devices, so the plain name is used.
        device = accelerator.device if accelerator.device.type != "cpu" else torch.device("cpu")
        host_group = host_group_for_default(cfg.distributed.timeout_minutes) if distributed else None
        return cls(rank=accelerator.process_index, world_size=accelerator.num_processes,
                   local_rank=accelerator.local_process_index,
                   local_world_size=env["LOCAL_WORLD_SIZE"] if env is not None else 1,
                   strategy=strategy, backend=state.backend if distributed else None,
                   owns_group=dist.is_initialized() and not had_group, accelerator=accelerator,
                   device=device, _saved_env=saved_env, _host_group=host_group)

    def close(self, finished: bool = False) -> None:
        """Release the Accelerator's process-wide state, and the process group it created.

        A run that `finished` on this rank waits for the others first: a process group torn down
        while another rank's last collective is still in flight can abort that rank at exit. A rank
        leaving on an error does not wait (the others may never come)."""
        if finished:
            self.barrier()
        if self.accelerator is not None:
            from .accelerate_setup import release_accelerator

            self.accelerator = None
            release_accelerator(self._saved_env or {})
        import torch.distributed as dist

        if self._host_group is not None and not self.owns_group and dist.is_initialized():
            dist.destroy_process_group(self._host_group)
        self._host_group = None
        if self.owns_group:
            if dist.is_initialized():
                dist.destroy_process_group()
            self.owns_group = False

    def quiet_logging(self, logger: logging.Logger) -> None:
        """Ranks other than 0 log warnings and errors only, to stderr, prefixed with their rank (rank
        0 writes the run's log file, TensorBoard and progress bar)."""
        logger.setLevel(logging.WARNING)
        for h in list(logger.handlers):
            logger.removeHandler(h)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[rank {self.rank}] %(message)s"))
        logger.addHandler(handler)

    # -- collectives ---------------------------------------------------------------------------------
    # The step's small agreements (loss sum, votes, observations, object broadcasts) carry host
    # tensors. NCCL serves CUDA tensors only ("No backend type associated with device type cpu"), so
    # they go over `_host_group` (gloo) whenever the default group has no CPU backend; a GPU run then
    # never copies a flag to the device and back (no synchronize) to agree on it.
    @property
    def host_group(self):
        """The group for host tensors: None (the default group) when it serves the CPU."""
        return self._host_group

    def group_for(self, device: torch.device):
        """The group whose backend serves tensors of `device` (None: the default group)."""
        if device.type == "cpu":
            return self._host_group
        if not _serves(None, device.type):
            raise RuntimeError(f"the process group has no backend for {device.type} tensors "
                               f"({_backend_config(None)})")
        return None

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self._host_group)

    def main_first(self, fn: Callable, what: str = "filling the caches"):
        """Run `fn` on rank 0, then on the others: caches are filled once and the other ranks find
        every entry present. A failure on rank 0 still releases the others, who then fail on their
        own (a missing file) rather than wait forever.

        The others wait by polling a key rank 0 sets in the run's store (`wait_for_main`), not in a
        barrier: a collective has the group's timeout ([distributed] timeout_minutes, torch's 30
        minutes by default), and rank 0's phase (caching thousands of captions, a slow disk) has no
        bound known in advance. A rank 0 that dies ends the wait (torchrun stops the ranks; a store
        that stops answering is an error naming it)."""
        if not self.distributed:
            return fn()
        key = self._next_key("main_first")
        if self.is_main:
            try:
                return fn()
            finally:
                _default_store().set(key, "done")
        wait_for_main(_default_store(), key, what, self.rank)
        return fn()

    def _next_key(self, kind: str) -> str:
        """A store key unique to this call in the process group's life: the n-th call of this rank
        (counted in the store itself, so a later run's context in the same group goes on counting),
        which every rank reaches in the same order."""
        n = _default_store().add(f"leantune/{kind}/calls/rank{self.rank}", 1)
        return f"leantune/{kind}/{n}"

    def sum(self, value: float) -> float:
        if not self.distributed:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._host_group)
        return float(t.item())

    def step_total(self, loss: float) -> float:
        """The step's closing collective: the sum of every rank's weighted loss, and whether a rank
        failed after the gradient vote (`agreed_step` sends that rank's failure here, in the same
        shape, so no rank is left in a collective the others never enter)."""
        if not self.distributed:
            return loss
        total, failed = self._closing(loss, failed=False)
        if failed:
            raise StepFailedAfterVote(self._after_vote_message(
                self._step, f"rank(s) {', '.join(map(str, failed))} failed after the gradient vote"))
        return total

    def _closing(self, loss: float, failed: bool) -> tuple[float, list[int]]:
        import torch.distributed as dist

        flags = [0.0] * self.world_size
        flags[self.rank] = 1.0 if failed else 0.0
        t = torch.tensor([loss, *flags], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._host_group)
        return float(t[0]), [r for r in range(self.world_size) if t[1 + r] > 0]

    def _after_vote_message(self, step: int | None, why: str) -> str:
        at = f"step {step}" if step is not None else "a step"
        return (f"rank {self.rank}: {at} failed after the ranks agreed on its gradients ({why}): the other "
                f"ranks' optimizer steps may have run, so the step cannot be redone on one rank without the "
                f"ranks' weights drifting apart; the run ends on every rank and the last save is intact. "
                f"Lower [memory] vram_budget or [data] batch_size, then resume with --resume.")

    def gather(self, value: float) -> list[float]:
        """`value` from every rank, in rank order (e.g. per-rank memory for rank 0's log)."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, float(value), group=self._host_group)
        return [float(v) for v in out]

    def rank_memory(self, sample) -> str:
        """', per rank: rss 1.2 1.3 GiB, vram peak 5.1 5.0 GiB' from every rank's latest memory sample
        (a leantune.memory.monitor.MemorySample); empty for one process. Every rank must call it."""
        if not self.distributed:
            return ""
        rss = self.gather(sample.rss if sample is not None else 0)
        vram = self.gather((sample.peak_allocated or 0) if sample is not None else 0)
        text = ", per rank: rss " + " ".join(f"{v / 2**30:.2f}" for v in rss) + " GiB"
        if any(vram):
            text += ", vram peak " + " ".join(f"{v / 2**30:.2f}" for v in vram) + " GiB"
        return text

    def agree_observation(self, peak: int, seconds: float, report: dict | None) -> tuple[int, float, dict | None]:
        """One step's measurements as every rank will use them: the largest peak and time of all
        ranks and rank 0's streaming report, so every rank's calibration makes the same re-plan
        decision (a re-plan on some ranks only would leave the others waiting in a collective)."""
        if not self.distributed:
            return peak, seconds, report
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, (int(peak), float(seconds), report), group=self._host_group)
        return max(o[0] for o in out), max(o[1] for o in out), out[0][2]

    def agree_machine(self, machine):
        """The machine every rank plans for (a leantune.planner.machine.Machine): rank 0's rates
        with the smallest free and total VRAM and host RAM of all ranks. Each rank probes its own
        GPU; planning from those would give each rank its own plan (`vram_budget = "auto"` reads
        the free VRAM), which breaks the shared host copy and the ranks' common re-plans. With one
        machine every rank's planner makes the same plan, fitting the tightest GPU."""
        if not self.distributed:
            return machine
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, machine.to_dict(), group=self._host_group)
        agreed = dict(out[0])
        for key in ("vram_total", "vram_free", "host_ram_total", "host_ram_available"):
            values = [o[key] for o in out if o[key] is not None]
            agreed[key] = min(values) if values else None
        return type(machine)(**agreed)      # the planner's Machine, rebuilt without importing the planner

    def vote(self, ok: bool) -> bool:
        """True when every rank's `ok` is True (one all-reduce of one number)."""
        if not self.distributed:
            return ok
        import torch.distributed as dist

        t = torch.tensor([0.0 if ok else 1.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._host_group)
        return t.item() == 0.0

    def shared_host(self, share_host_weights: bool, mode_name: str):
        """Shared host buffers for the streamed weights when several processes of this machine
        train a LoRA (frozen base) with [distributed] share_host_weights; else None. Collective:
        every rank calls it (rank 0 names the files)."""
        if not (self.distributed and self.local_world_size > 1 and share_host_weights and mode_name == "lora"):
            return None
        import uuid

        import torch.distributed as dist

        from .memory.shared_host import SharedHostBuffers

        box = [uuid.uuid4().hex[:12] if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self._host_group)
        return SharedHostBuffers(box[0], leader=self.is_local_main)

    def local_main_first(self, fn: Callable, shared=None):
        """Run `fn` (applying the memory plan) on each machine's first process, then on the others,
        which map the buffers it filled; then drop the shared files' names (see shared_host.py)."""
        if shared is None:
            return fn()
        if self.is_local_main:
            try:
                result = fn()
            finally:
                self.barrier()
            self.barrier()
            shared.unlink()
        else:
            self.barrier()
            try:
                result = fn()
            finally:
                self.barrier()
        if shared.mapped_bytes or shared.private:
            log.info(shared.describe())
        return result

    def local_turns(self, fn: Callable, shared=None):
        """Run `fn` (load the model, apply its memory plan) on this machine's processes one after
        another, local rank 0 first, a barrier between turns: the machine then holds one process's
        loading peak at a time beside the steady state of those done before, instead of N loading
        peaks at once. Local rank 0 fills the shared host buffers; the later turns map them. Once
        every turn is done the shared files' names are dropped (see shared_host.py). Collective:
        every rank calls it (ranks of other machines take the same turns on theirs)."""
        if not self.distributed:
            return fn()
        result = None
        turns = int(max(self.gather(self.local_world_size)))   # machines may run different process counts
        for turn in range(turns):
            if self.local_rank == turn:
                try:
                    with machine_threads():   # the machine's cores are this turn's (torchrun gave each rank 1)
                        result = fn()
                finally:
                    self.barrier()       # a failure still releases the others, who then fail on their own
            else:
                self.barrier()
        if shared is not None:
            if self.is_local_main:
                shared.unlink()
            if shared.mapped_bytes or shared.private:
                log.info(shared.describe())
        return result

    # -- the step ------------------------------------------------------------------------------------
    def agreed_step(self, step_fn: Callable[[], float], step: int | None = None) -> float:
        """Run one step's local work; an out-of-memory error here is announced to the other ranks
        (they raise `RankOutOfMemory` at their next vote) before it is re-raised, so every rank's
        OOM guard re-plans and redoes the same step. See the module docstring.

        Full fine-tunes sharded by FSDP2 or DeepSpeed cannot do that: their collectives run inside
        forward and backward (FSDP2 gathers each block's weights, ZeRO-2 reduces gradient buckets
        from backward hooks), so when one rank fails the others are already waiting inside one, and
        a vote would be a mismatched collective (a hang until the timeout). There is no memory plan
        to change either (streaming is refused with them). So the failing rank raises
        `ShardedOutOfMemory` and leaves; its closed connections end the others' collectives (gloo)
        or the launcher stops them (torchrun), and the last save stays the resumable state."""
        if not self.distributed:
            return step_fn()
        self._after_vote, self._step = False, step
        try:
            return step_fn()
        except Exception as exc:
            if self._after_vote and not isinstance(exc, StepFailedAfterVote):
                # The others passed the vote too and are on their way to the step's closing sum:
                # meet them there with this rank's failure, then every rank ends.
                self._after_vote = False
                log.error("rank %d failed after the gradient vote: %s", self.rank, exc)
                self._closing(0.0, failed=True)
                # The text names the error's type only: an allocator's message would make this
                # look like an out-of-memory error, which the OOM guard would re-plan and redo.
                raise StepFailedAfterVote(self._after_vote_message(
                    step, f"rank {self.rank} failed after the gradient vote: {type(exc).__name__}")) from exc
            if is_out_of_memory(exc) and not isinstance(exc, RankOutOfMemory):
                if self.strategy in ("fsdp2", "deepspeed"):
                    at = f" in step {step}" if step is not None else ""
                    raise ShardedOutOfMemory(
                        f"rank {self.rank}: out of memory{at} of a full fine-tune on {self.world_size} processes "
                        f"({self.strategy}): the other ranks are inside {self.strategy}'s collectives of this step, so "
                        f"the ranks cannot re-plan together; the run ends here and the last save is intact. Lower "
                        f"[data] batch_size or the resolution, or add processes, then resume with --resume. "
                        f"({exc})") from exc
                log.warning("rank %d: out of memory; telling the other ranks to re-plan too", self.rank)
                self.vote(False)
            raise

    def sync_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """After the last micro-batch: agree that every rank got here, then sum the gradients
        (each rank's loss was already weighted by its share of the global batch)."""
        if not self.distributed:
            return
        import torch.distributed as dist

        if not self.vote(True):
            raise RankOutOfMemory("CUDA out of memory on another rank in this step (this rank's step was fine); "
                                  "re-planning together")
        self._after_vote = True          # from here on a failure cannot be redone by one rank alone
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = g
        by_device: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_device.items():
            flat = torch._utils._flatten_dense_tensors(group)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group_for(device))
            for g, reduced in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                g.copy_(reduced)

    def shard_batches(self, data, seed: int, batch_size: int):
        """The batch iterator for this rank: global batches of `batch_size x world_size`, cut to this
        rank's rows (one process: the plain iterator)."""
        if not self.distributed:
            return data.batches(seed=seed)
        return ShardedBatches(data.batches(seed=seed, batch_size=batch_size * self.world_size), self.rank,
                              self.world_size)

    def check_resume(self, state: dict, ckpt, allow_change: bool) -> bool:
        """Compare the checkpoint's world size with this run's. Returns whether the data position can
        be resumed exactly; a change is refused unless `allow_change` (then the run continues at the
        start of the next epoch, which the message says)."""
        saved = int(state.get("world_size", 1))
        if saved == self.world_size:
            return True
        what = (f"{ckpt} was saved by a run on {saved} process(es); this run has {self.world_size}. "
                f"Each step's global batch is [data] batch_size x processes, so the batch order of the saved "
                f"run cannot continue exactly")
        if not allow_change:
            raise CheckpointError(f"{what}. Resume with {saved} process(es), or set [distributed] "
                                  f"allow_world_size_change = true to continue at the start of the next epoch "
                                  f"(weights, optimizer and step count are kept; the rest of this epoch is skipped).")
        log.warning("%s: continuing at the start of the next epoch (allow_world_size_change = true)", what)
        return False


def _backend_config(group) -> str:
    from torch.distributed import distributed_c10d as c10d

    return str(c10d._world.pg_backend_config.get(group or c10d._get_default_group(), "?"))


def _serves(group, device_type: str) -> bool:
    """Whether `group` (None: the default group) has a backend for tensors of `device_type`."""
    from torch.distributed import distributed_c10d as c10d

    pg = group or c10d._get_default_group()
    types = getattr(pg, "_device_types", None)
    if types is not None:
        return any(d.type == device_type for d in types)
    config = _backend_config(group)            # "gloo", "nccl" or "cpu:gloo,cuda:nccl"
    if ":" in config:
        return any(part.split(":")[0] == device_type for part in config.split(","))
    return (config == "gloo") if device_type == "cpu" else config in ("gloo", "nccl")


# How often a rank waiting for rank 0 (main_first) looks at the store, and how often it says so.
MAIN_POLL_S = 0.5
MAIN_REPORT_S = 300.0


def _default_store():
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def wait_for_main(store, key: str, what: str, rank: int, poll_s: float | None = None,
                  report_s: float | None = None) -> None:
    """Wait, without any timeout, until rank 0 sets `key` in `store`; a line to the log every
    `report_s` seconds says what is awaited. `store.check` does not block (a blocking `wait` would
    need a timeout and logs a socket warning at each one). A store that stops answering (rank 0,
    which serves it, is gone) is a RuntimeError naming it."""
    import time

    poll_s = MAIN_POLL_S if poll_s is None else poll_s
    report_s = MAIN_REPORT_S if report_s is None else report_s
    start = last = time.monotonic()
    while True:
        try:
            if store.check([key]):
                return
        except Exception as e:     # noqa: BLE001 - the store's own error says which connection
            raise RuntimeError(f"rank {rank}: rank 0 stopped answering while this rank waited for it "
                               f"({what}): {e}") from None
        now = time.monotonic()
        if now - last >= report_s:
            log.info("rank %d: waiting for rank 0 (%s), %.0f min so far", rank, what, (now - start) / 60)
            last = now
        time.sleep(poll_s)


def host_group_for_default(timeout_minutes: int | None = None):
    """A gloo group beside a default group that has no CPU backend (NCCL), else None. Collective:
    every rank calls it once, in the same order as its other group creations.

    `timeout_minutes` is the run's `[distributed] timeout_minutes`: without it the group gets
    torch's 30-minute default, and a rank-0-only phase longer than that (caching thousands of
    captions, a slow load turn) kills the ranks waiting at `main_first`'s barrier on this group."""
    import datetime

    import torch.distributed as dist

    if _serves(None, "cpu"):
        return None
    if timeout_minutes is None:
        return dist.new_group(backend="gloo")
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class machine_threads:
    """Within: torch's intra-op threads are every core this process may use; after: as before.

    Why: torchrun sets OMP_NUM_THREADS=1 for several processes, so each rank's load (reading,
    casting, the C quantizer, which sizes its worker pool from torch's thread count) would run
    on one core during its loading turn while the other ranks wait at a barrier and the machine's
    other cores idle. In a turn the machine is this rank's; outside it, the ranks share it, and
    torchrun's one thread each stays."""

    def __enter__(self):
        self._before = torch.get_num_threads()
        cores = machine_cores()
        if cores > self._before:
            torch.set_num_threads(cores)
        return self

    def __exit__(self, *exc):
        if torch.get_num_threads() != self._before:
            torch.set_num_threads(self._before)
        return False


def launch_env() -> dict | None:
    """RANK / WORLD_SIZE / LOCAL_RANK (and LOCAL_WORLD_SIZE) as set by torchrun or accelerate, or None."""
    if not all(k in os.environ for k in ENV_VARS):
        return None
    env = {k: int(os.environ[k]) for k in ENV_VARS}
    env["LOCAL_WORLD_SIZE"] = int(os.environ.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
    return env


def resolve_strategy(strategy: str, train_mode: str) -> str:
    """The strategy `[distributed] strategy = "auto"` means for a run of `[train] mode`: DDP for
    LoRA, FSDP2 for a full fine-tune (it needs no extra package; DeepSpeed ZeRO-2 is
    `strategy = "deepspeed"`)."""
    if strategy != "auto":
        return strategy
    return "fsdp2" if train_mode == "full" else "ddp"


@dataclass(frozen=True)
class Nodes:
    """A run on several machines (`leantune train --nodes M --node-rank R --master HOST:PORT`)."""

    count: int
    rank: int
    host: str
    port: int


def torchrun_command(gpus: int, argv: list[str], nodes: Nodes | None = None) -> list[str]:
    """The command `leantune train ... --gpus N` runs: torchrun on this machine with N processes,
    each running `leantune <argv>` (the same arguments without --gpus). With `nodes`, this machine
    is one of several: torchrun's static rendezvous at machine 0's address, ranks R*N .. R*N+N-1
    here (every machine runs the same --gpus)."""
    import sys

    where = ["--standalone"] if nodes is None else [
        f"--nnodes={nodes.count}", f"--node_rank={nodes.rank}", f"--master_addr={nodes.host}",
        f"--master_port={nodes.port}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={gpus}",
            "-m", "leantune", *argv]


class WorkerFailed(RuntimeError):
    """A process of a `--gpus N` run failed or was killed; names the rank and the last save."""


class LauncherStopped(KeyboardInterrupt):
    """The launcher of a `--gpus N` run got SIGTERM/SIGINT: its workers were stopped (each saves
    its state at the end of its step, as one process does); the CLI reports it as a stop."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def relaunch(gpus: int, argv: list[str], last_save: Callable[[], Path | None] | None = None,
             nodes: Nodes | None = None) -> int:
    """Run torchrun's launcher in this process (so Ctrl-C and kill reach the launcher itself, and
    the workers, whose parent it is, die with it); each worker runs `leantune <argv>`. A worker
    that fails ends the run with a `WorkerFailed` naming its rank, how it ended and the last save
    (`last_save()`, the caller's: the checkpoint layout is the trainer's), instead of torchrun's
    ChildFailedError report."""
    import sys

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    cmd = torchrun_command(gpus, argv, nodes)
    where = "" if nodes is None else f" (machine {nodes.rank} of {nodes.count})"
    log.info("starting %d processes%s: %s", gpus, where, " ".join(cmd))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        run(parse_args(cmd[3:]))          # the arguments after `python -m torch.distributed.run`
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise WorkerFailed(_failure_message(rank, failure, gpus, last_save() if last_save else None,
                                            several_machines=nodes is not None)) from None
    except SignalException as e:
        import signal

        raise LauncherStopped(signal.Signals(e.sigval).name) from None
    return 0


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
              "ProcessGroupGloo", "ProcessGroupNCCL", "Connection refused")


def peer_lost(e: BaseException) -> bool:
    """A collective failed because another process of the run is gone (killed, crashed): the
    launcher names it (relaunch); this process only needs to say so, not print a traceback."""
    if launch_env() is None or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    dist_error = getattr(torch.distributed, "DistError", ())
    return isinstance(e, dist_error) or (isinstance(e, RuntimeError) and any(p in str(e) for p in _PEER_LOST))


def _failure_message(rank: int, failure, gpus: int, last: Path | None, several_machines: bool = False) -> str:
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    else:
        how = f"exited with code {failure.exitcode} (its message is above)"
    saved = (f"the last save ({last}) is intact: run the same command with --resume to continue from it"
             if last is not None else "no state had been saved yet")
    others = (f"this machine's other {gpus - 1} process(es) were stopped" if several_machines and gpus > 1
              else "this machine's processes ended (a process of another machine may have ended first)"
              if several_machines else f"the other {gpus - 1} process(es) were stopped")
    return f"rank {rank} (pid {failure.pid}) {how}; {others}; {saved}"


def die_with_launcher() -> None:
    """Linux: end this worker when its launcher dies, however it died (kill -9 included), instead of
    training on as an orphan. The last save stays the resumable state."""
    import sys

    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:         # the launcher is already gone
        os.kill(os.getpid(), signal.SIGKILL)
