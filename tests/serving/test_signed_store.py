"""Signed store messages: a forged value is refused, and a flood of them is one log line and a count."""

import time

import pytest
import torch.distributed as dist

from torchtitan_rl.serving.signed_store import Rejections, SignedStore
from torchtitan_rl.weight_sync.store import ForgedMessage


def test_a_flood_of_forged_messages_is_one_line_then_one_count_per_window():
    lines = []
    rejections = Rejections(every_s=0.5, log=lines.append)
    inner = dist.HashStore()
    store = SignedStore(inner, secret="secret", session="abcdef0123", rejections=rejections)
    for i in range(2329):  # what a tokenless writer got into the server's log in 30 s, one line each
        inner.set("header/1", f"forged {i}")
        with pytest.raises(ForgedMessage):
            store.get("header/1")
    assert len(lines) == 1 and "rejected a store message at 'header/1' in session abcdef01" in lines[0], lines
    deadline = time.monotonic() + 5
    while len(lines) < 2:
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)
    assert lines[1] == "torchtitan_rl: rejected 2328 forged store messages in the last 0.5 s from session abcdef01"
    assert rejections.totals == {"forged store messages": 2329}
    store.set("header/1", "genuine")  # the real one, when it comes, is read
    assert store.get("header/1") == b"genuine"
    time.sleep(1.2)  # the attack stopped: no more lines
    assert len(lines) == 2
