"""The pipeline's control messages between two gloo processes (`distributed/group.py`): an `Inbox` keeps
its receives posted, so the sender's one-frame messages complete while the receiver is busy elsewhere;
`post_object` returns before the receiver reads; messages longer than a frame arrive whole and in order.
A stage's output and its input ids packed in one buffer come back whole (any width, any dtype).

A sender that had to wait for the receiver here would wait for a message the receiver only sends after
reading, so a regression shows as the group's timeout (an error), not as a slow test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tierlm.distributed.group import FRAME_BYTES, PipelineGroup, free_tcp_address

TIMEOUT_S = 30.0
GO_TAG = 9  # the receiver's "now I read" to the sender


def _messages() -> list:
    big = np.arange(3 * FRAME_BYTES // 8, dtype=np.int64)  # three frames' worth: a second frame
    return [{"n": 0}, {"n": 1, "array": big}, {"n": 2, "text": "x" * 10}, {"n": 3}]


def _rank(rank: int, address: str, failures) -> None:

    group = None
    try:
        group = PipelineGroup.join(rank, 2, torch.device("cpu"), address, TIMEOUT_S)
        if rank == 1:
            inbox = group.inbox(0, depth=len(_messages()))
            group.recv_object(0, tag=GO_TAG)  # rank 0 sent every message before this, unread so far
            got = [inbox.get() for _ in _messages()]
            expected = _messages()
            assert [m["n"] for m in got] == [m["n"] for m in expected]
            assert np.array_equal(got[1]["array"], expected[1]["array"]) and got[2]["text"] == expected[2]["text"]
            group.send_object("read", 0, tag=GO_TAG)
        else:
            messages = _messages()
            group.send_object(messages[0], 1)  # a one-frame message completes: rank 1's inbox has receives posted
            # a longer one's second frame is received only once rank 1 reads its first: started, not waited for
            posted = [work for message in messages[1:] for work in group.post_object(message, 1)]
            group.send_object("go", 1, tag=GO_TAG)
            assert group.recv_object(1, tag=GO_TAG) == "read"
            for work in posted:
                work.wait()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        failures.put(f"rank {rank}: {type(exc).__name__}: {exc}")
    finally:
        if group is not None:
            group.close()


def test_inbox_takes_messages_while_the_receiver_is_busy_whole_and_in_order():
    context = mp.get_context("spawn")
    failures = context.Queue()
    address = free_tcp_address()
    processes = [context.Process(target=_rank, args=(rank, address, failures)) for rank in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=2 * TIMEOUT_S)
    problems = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    assert not problems, problems
    assert [process.exitcode for process in processes] == [0, 0]


@pytest.mark.parametrize("size", [0, 100, FRAME_BYTES - 8 - 64, FRAME_BYTES, 5 * FRAME_BYTES])
def test_frames_hold_any_payload(size):
    from tierlm.distributed.group import _frames, _parse

    message = b"\x07" * size
    frame, rest = _frames(message)
    assert frame.numel() == FRAME_BYTES
    received = []

    def receive_rest(tensor):
        assert rest is not None and tensor.numel() == rest.numel()
        tensor.copy_(rest)
        received.append(tensor.numel())

    assert _parse(frame, receive_rest) == message
    assert bool(received) == (rest is not None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage_output_and_ids_share_one_buffer(dtype):
    from tierlm.engine.pipeline_messages import pack_stage_output, stage_buffer, unpack_stage_input

    hidden = torch.randn(3, 5, dtype=dtype)  # 30 bytes of bf16: the ids start at the next 8-byte boundary
    ids = torch.tensor([7, -1, 2**40])
    packed = pack_stage_output(hidden, ids)
    assert packed.dtype == torch.uint8 and packed.shape == stage_buffer(3, 5, dtype, packed.device).shape
    received = torch.empty_like(packed).copy_(packed)  # what the next stage's receive fills
    got_hidden, got_ids = unpack_stage_input(received, 3, 5, dtype)
    assert torch.equal(got_hidden, hidden) and torch.equal(got_ids, ids)


def test_step_message_pickles_whole():
    """A step message travels as plain tuples (`StepMessage.__reduce__`) and comes back equal."""
    import pickle

    from tierlm.engine.pipeline_messages import DecodeRows, DraftChunk, SampleSpec, StepMessage

    bitmask = np.array([-1, 5], dtype=np.int32)
    message = StepMessage(step=7, decode=DecodeRows([9, 40], [0, 3], [(0, 0, [1]), (4, 1, [6])]), cache_ops=[("reset_slot", (3,))],
                          released=[2], samples=[SampleSpec(0, 0, 1, 9, 1, True), SampleSpec(4, 1, 1, 40, 1, True, bitmask)],
                          drafts=[DraftChunk(0, 9, 1, True, [5, 8], 0, 0, [1]), DraftChunk(4, 40, 1, False, [], 3, 3, [6, 2])])
    back = pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    assert np.array_equal(back.samples[1].bitmask, bitmask)
    back.samples[1].bitmask = message.samples[1].bitmask = None
    assert back == message
    echo = pickle.loads(pickle.dumps(StepMessage(kind="echo", echo_shape=(2, 8), echo_repeats=3)))
    assert (echo.kind, echo.echo_shape, echo.echo_repeats, echo.decode) == ("echo", (2, 8), 3, None)


def test_block_lists_travel_as_changes():
    """A decode step carries each request's new blocks only; the receiving rank keeps one list per request
    while it grows (the static runner then sends only the new entries), a new one when it was replaced."""
    from tierlm.engine.pipeline_messages import BlockListChanges, BlockLists

    changes, lists = BlockListChanges(), BlockLists()
    blocks = [4, 9]
    first = changes.change(0, blocks)
    held = lists.apply([first])[0]
    blocks += [11]
    grown = changes.change(0, blocks)
    assert first == (0, 0, [4, 9]) and grown == (0, 2, [11])
    assert lists.apply([grown])[0] is held and held == [4, 9, 11]
    readmitted = [7]  # preempted and readmitted: another list object, sent whole
    again = lists.apply([changes.change(0, readmitted)])[0]
    assert again == [7] and again is not held
    changes.forget([0])
    lists.forget([0])
    assert changes.change(0, readmitted) == (0, 0, [7])
    with pytest.raises(RuntimeError, match="rank 0 counts on 3"):
        BlockLists().apply([(5, 0, [1, 2]), (5, 3, [8])])  # out of step with rank 0: an error, not a wrong table
