"""The pipeline's processes and how they talk: torch.distributed groups, framed messages, liveness.

What this module owns: starting the ranks (spawned by rank 0 with torch.multiprocessing's spawn
context, or started by torchrun: RANK / WORLD_SIZE / LOCAL_RANK in the environment), joining them in
process groups with a timeout on every collective, and moving data between ranks:
- `send_object` / `post_object` / `recv_object` / `Inbox`: a pickled object over the gloo group (step
  descriptions from rank 0, sampled tokens back to it) as one fixed-size frame (its length, then the
  payload; a payload longer than the frame sends the rest as a second frame on a tag of its own). A gloo
  send waits until the receiver has posted its receive, so a rank that receives a flow of messages keeps
  an `Inbox`: `depth` frame receives always posted, so a message costs one hop (not a length frame, the
  receiver's round trip, then the payload) and the sender never waits for the receiver to finish what it
  is doing (rank 0 sends the next micro-batch while the last rank samples the previous one); rank 0 also
  only starts its sends (`post_object`) and waits for them when the step's answer is back;
- `isend` / `irecv`: a tensor over the device group (NCCL on CUDA, the same gloo group on CPU): each
  stage's output (hidden state and token ids) to the next, straight from device memory;
- `send_ids` / `recv_ids`: the last rank's sampled ids to rank 0 over a device group of their own (NCCL on
  CUDA: a communicator and stream of their own), so rank 0's next step can take them as input on its
  device before its host has read them; one direction per communicator, so no send waits behind a
  receive of the other direction.
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
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

STEP_TAG, HIDDEN_TAG, RESULT_TAG, CONTROL_TAG, TOKEN_TAG = 1, 2, 3, 4, 5
REST_TAG_OFFSET = 16  # a message's second frame (the payload past its first frame) goes on tag + this
# a message's first frame: 8 bytes of payload length, then the payload's first bytes; a decode step's
# description fits in one up to a few thousand blocks of context in all (block tables are most of it)
FRAME_BYTES = 32 * 1024
_HEAD_BYTES = FRAME_BYTES - 8
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
    token_group: object  # NCCL on CUDA, else gloo; ranks 0 and last: sampled ids, last to 0 only

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
        token_group = dist.new_group([0, world_size - 1], backend=backend, timeout=timeout)
        return cls(rank, world_size, device, cpu_group, dist.group.WORLD, result_group, token_group)

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def send_object(self, obj, dst: int, tag: int = STEP_TAG, group=None) -> None:
        for work in self.post_object(obj, dst, tag, group):
            work.wait()

    def post_object(self, obj, dst: int, tag: int = STEP_TAG, group=None) -> list:
        """Start sending a message and return its sends (each holds its buffer): the caller waits for
        them later, so a long message's second frame never holds it up until the receiver reads the first."""
        group = group or self.cpu_group
        frame, rest = _frames(obj)
        works = [dist.isend(frame, dst, group=group, tag=tag)]
        if rest is not None:
            works.append(dist.isend(rest, dst, group=group, tag=tag + REST_TAG_OFFSET))
        return works

    def recv_object(self, src: int, tag: int = STEP_TAG, group=None):
        """One message, its frame received now (for a flow of messages use an `inbox`)."""
        group = group or self.cpu_group
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        dist.recv(frame, src, group=group, tag=tag)
        return _parse(frame, lambda rest: dist.recv(rest, src, group=group, tag=tag + REST_TAG_OFFSET))

    def inbox(self, src: int, tag: int = STEP_TAG, group=None, depth: int = 2) -> Inbox:
        return Inbox(group or self.cpu_group, src, tag, depth)

    def isend(self, tensor: torch.Tensor, dst: int):
        return dist.isend(tensor.contiguous(), dst, group=self.device_group, tag=HIDDEN_TAG)

    def irecv(self, tensor: torch.Tensor, src: int):
        return dist.irecv(tensor, src, group=self.device_group, tag=HIDDEN_TAG)

    def send_ids(self, tensor: torch.Tensor):
        """The last rank: a step's sampled ids (a device tensor) to rank 0, started."""
        return dist.isend(tensor, 0, group=self.token_group, tag=TOKEN_TAG)

    def recv_ids(self, tensor: torch.Tensor):
        """Rank 0: the next step's sampled ids from the last rank, posted (on CUDA `wait()` only makes the
        current stream wait for them)."""
        return dist.irecv(tensor, self.world_size - 1, group=self.token_group, tag=TOKEN_TAG)

    def all_gather_object(self, obj) -> list:
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.cpu_group)
        return gathered

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class Inbox:
    """The messages one rank sends this one on one tag, with `depth` frame receives always posted (in
    order: gloo matches a source's messages on a tag to its posted receives first in, first out). Every
    call of `get` waits for the oldest, reads it and posts its frame's receive again. One thread uses it."""

    def __init__(self, group, src: int, tag: int, depth: int) -> None:
        self.group, self.src, self.tag = group, src, tag
        self._posted: deque = deque()
        for _ in range(max(1, depth)):
            self._post(torch.empty(FRAME_BYTES, dtype=torch.uint8))

    def _post(self, frame: torch.Tensor) -> None:
        self._posted.append((frame, dist.irecv(frame, self.src, group=self.group, tag=self.tag)))

    def ready(self) -> bool:
        """Whether the next message's frame is in (`get` then returns without waiting for the sender)."""
        return self._posted[0][1].is_completed()

    def get(self):
        """The next message (waits up to the group's timeout)."""
        frame, work = self._posted.popleft()
        work.wait()
        rest_tag = self.tag + REST_TAG_OFFSET
        message = _parse(frame, lambda rest: dist.recv(rest, self.src, group=self.group, tag=rest_tag))
        self._post(frame)  # after the parse: the frame is overwritten by the message after next
        return message


def _frames(obj) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A message's first frame (FRAME_BYTES: the payload's length, then its first bytes) and the rest of
    the payload (None when it fits the frame)."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    frame = bytearray(FRAME_BYTES)
    frame[:8] = len(payload).to_bytes(8, "little")
    frame[8 : 8 + min(len(payload), _HEAD_BYTES)] = payload[:_HEAD_BYTES]
    rest = None
    if len(payload) > _HEAD_BYTES:
        rest = torch.frombuffer(bytearray(payload[_HEAD_BYTES:]), dtype=torch.uint8)
    return torch.frombuffer(frame, dtype=torch.uint8), rest


def _parse(frame: torch.Tensor, receive_rest):
    """The object in a received frame; receive_rest(tensor) fills in the payload past the frame."""
    view = frame.numpy()
    length = int.from_bytes(view[:8].tobytes(), "little")
    if length <= _HEAD_BYTES:
        return pickle.loads(view[8 : 8 + length])
    rest = torch.empty(length - _HEAD_BYTES, dtype=torch.uint8)
    receive_rest(rest)
    return pickle.loads(view[8:].tobytes() + rest.numpy().tobytes())


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
