"""A trainer that dies in the middle of a sync (tests/serving/test_server.py).

python server_trainer_worker.py PORT TOKEN API_KEY DIE_AFTER [stop]: connects to
the rollout server, syncs version 30 in full, then starts syncing version 31
in 4 KiB buckets and exits (code 3) right after its DIE_AFTER-th broadcast of
it has left, as a killed process would: no error message, no goodbye. With
``stop`` it stops itself there instead (SIGSTOP: a hung trainer, or one
behind a dead link) for the test to kill -9.
"""

import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import native_state, trainer_model  # noqa: E402
from torchtitan_rl.config import load_toml  # noqa: E402
from torchtitan_rl.rollout.server_client import ServerGenerator  # noqa: E402
from torchtitan_rl.distributed.process_group import init_process_group  # noqa: E402
from torchtitan_rl.weight_sync import nccl_sender  # noqa: E402


def main(port: int, token: str, api_key: str, die_after: int, stop: bool) -> None:
    cfg = load_toml(Path(__file__).resolve().parents[2] / "run_configs" / "cpu_tiny.toml")
    cfg.serve.port, cfg.serve.token, cfg.serve.api_key = port, token, api_key
    cfg.serve.takeover = True  # it follows the test's own trainers on one server
    cfg.weight_sync.peer_timeout_s = 60.0
    init_process_group(torch.device("cpu"))
    generator = ServerGenerator(cfg, reference=native_state(trainer_model(seed=0)), device=torch.device("cpu"))
    generator.sync(native_state(trainer_model(seed=30)), version=30)

    generator.sender.bucket_bytes = 4096  # many buckets: the death lands inside the sync
    broadcast, sent = nccl_sender.broadcast, [0]

    def broadcast_then_die(pair, tensor, root):
        work = broadcast(pair, tensor, root)
        work.wait()  # the bytes left this process
        sent[0] += 1
        if sent[0] == die_after:
            print("stalling" if stop else "dying", flush=True)
            if stop:
                os.kill(os.getpid(), signal.SIGSTOP)
            os._exit(3)
        return work

    nccl_sender.broadcast = broadcast_then_die
    generator.sync(native_state(trainer_model(seed=31)), version=31)
    sys.exit("the sync finished; the worker should have died in it")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:] == ["stop"])
