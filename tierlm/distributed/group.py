"""The pipeline's processes and how they talk: torch.distributed groups, framed messages, liveness.

What this module owns: starting the ranks (spawned by rank 0 with torch.multiprocessing's spawn
context, or started by torchrun: RANK / WORLD_SIZE / LOCAL_RANK in the environment), joining them in
process groups with a timeout on every collective, and moving data between ranks:
- `send_object` / `recv_object`: a pickled object as one length frame and one payload frame over the
  gloo group (step descriptions from rank 0, sampled tokens back to it);
- `isend` / `irecv`: a tensor over the device group (NCCL on CUDA, the same gloo group on CPU): the
  hidden state between stages.
Each flow has its own tag, so flows between the same two ranks never match each other's frames; the
results from the last rank to rank 0 have a group of their own, so rank 0 can wait for them on a thread
while its main thread sends. It does not know what the messages mean (`engine/pipeline.py` does).

Failure: a rank that dies closes its sockets and every rank blocked on it gets an error at once; a rank
that hangs is caught by the groups' timeout. Rank 0 also watches the processes it spawned, and names a
dead one by its rank and exit status.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

STEP_TAG, HIDDEN_TAG, RESULT_TAG, CONTROL_TAG = 1, 2, 3, 4
EXIT_PEER_LOST = 3  # a worker's exit status when another rank went away first


class PipelineError(RuntimeError):
    """A pipeline rank died, failed or stopped answering; the message names it."""


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (or another env:// launcher)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def free_tcp_address() -> str:
    """An init_method on a free local port, for ranks spawned on this host."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def rank_device(base: str | None, rank: int) -> torch.device:
    """Rank r's device: CUDA device (base index + r) (LOCAL_RANK under torchrun), else the CPU."""
    if base is None:
        base = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(base)
    if device.type != "cuda":
        return device
    if "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", (device.index or 0) + rank)


@dataclass
class PipelineGroup:
    """This process's place in the pipeline and its groups (the default group is `device_group`)."""

    rank: int
    world_size: int
    device: torch.device
    cpu_group: object  # gloo: messages
    device_group: object  # NCCL on CUDA, else the gloo group: hidden states
    result_group: object  # gloo, ranks 0 and last: results

    @classmethod
    def join(cls, rank: int, world_size: int, device: torch.device, init_method: str, timeout_s: float):
        if dist.is_initialized():
            raise ValueError("this process is in a pipeline already (one per process): close the other engine "
                             "first (LLMEngine.close)")
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
        result_group = dist.new_group([0, world_size - 1], backend="gloo", timeout=timeout)
        return cls(rank, world_size, device, cpu_group, dist.group.WORLD, result_group)

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def send_object(self, obj, dst: int, tag: int = STEP_TAG, group=None) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        group = group or self.cpu_group
        dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst, group=group, tag=tag)
        dist.send(payload, dst, group=group, tag=tag)

    def recv_object(self, src: int, tag: int = STEP_TAG, group=None):
        group = group or self.cpu_group
        length = torch.empty(1, dtype=torch.int64)
        dist.recv(length, src, group=group, tag=tag)
        payload = torch.empty(int(length), dtype=torch.uint8)
        dist.recv(payload, src, group=group, tag=tag)
        return pickle.loads(payload.numpy().tobytes())

    def isend(self, tensor: torch.Tensor, dst: int):
        return dist.isend(tensor.contiguous(), dst, group=self.device_group, tag=HIDDEN_TAG)

    def irecv(self, tensor: torch.Tensor, src: int):
        return dist.irecv(tensor, src, group=self.device_group, tag=HIDDEN_TAG)

    def all_gather_object(self, obj) -> list:
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.cpu_group)
        return gathered

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    if exitcode == EXIT_PEER_LOST:
        return "stopped: another rank went away"
    return f"exited with status {exitcode}"
