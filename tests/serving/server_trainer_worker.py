"""A trainer that dies, stalls, lives on or loses its server in the middle of its work (tests/serving/test_server.py).

python server_trainer_worker.py PORT TOKEN API_KEY DIE_AFTER [MODE [SERVER_PID PEER_TIMEOUT_S]]: connects to
the rollout server, syncs version 30 in full, then, by MODE:

- none: starts syncing version 31 in 4 KiB buckets and exits (code 3) right after its DIE_AFTER-th broadcast of
  it has left, as a killed process would: no error message, no goodbye;
- ``stop``: stops itself there instead (SIGSTOP: a hung trainer, or one behind a dead link) for the test to
  kill -9;
- ``stop-server``: stops the SERVER there (SIGSTOP to SERVER_PID: a frozen server) and goes on as the GRPO loop
  would, with weight_sync.peer_timeout_s = PEER_TIMEOUT_S: its sync fails and it exits with the command's one
  line (exit 2);
- ``live``: prints "training" and sleeps, as a trainer in a long train step, for the test to kill -9.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import native_state, trainer_model  # noqa: E402
from torchtitan_rl.config import load_toml  # noqa: E402
from torchtitan_rl.distributed.process_group import init_process_group  # noqa: E402
from torchtitan_rl.rollout.server_client import ServerGenerator  # noqa: E402
from torchtitan_rl.run.exits import one_line_errors  # noqa: E402
from torchtitan_rl.weight_sync import nccl_sender  # noqa: E402


def main(port: int, token: str, api_key: str, die_after: int, mode: str, server_pid: int, peer_timeout_s: float):
    cfg = load_toml(Path(__file__).resolve().parents[2] / "run_configs" / "cpu_tiny.toml")
    cfg.serve.port, cfg.serve.token, cfg.serve.api_key = port, token, api_key
    cfg.serve.takeover = True  # it follows the test's own trainers on one server
    cfg.weight_sync.peer_timeout_s = peer_timeout_s
    init_process_group(torch.device("cpu"))
    generator = ServerGenerator(cfg, reference=native_state(trainer_model(seed=0)), device=torch.device("cpu"))
    generator.sync(native_state(trainer_model(seed=30)), version=30)
    if mode == "live":
        print("training", flush=True)
        time.sleep(3600)

    generator.sender.bucket_bytes = 4096  # many buckets: the death lands inside the sync
    broadcast, sent = nccl_sender.broadcast, [0]

    def broadcast_then_die(pair, tensor, root):
        work = broadcast(pair, tensor, root)
        work.wait()  # the bytes left this process
        sent[0] += 1
        if sent[0] == die_after:
            if mode == "stop-server":
                os.kill(server_pid, signal.SIGSTOP)
                print("server stopped", flush=True)
                return work
            print("stalling" if mode == "stop" else "dying", flush=True)
            if mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            os._exit(3)
        return work

    nccl_sender.broadcast = broadcast_then_die
    with one_line_errors():  # as simple_grpo's main: a lost server is one line, and the generator is closed
        try:
            generator.sync(native_state(trainer_model(seed=31)), version=31)
        finally:
            generator.close()
    sys.exit("the sync finished; the worker should have died in it")


if __name__ == "__main__":
    args = sys.argv[1:]
    mode = args[4] if len(args) > 4 else ""
    main(int(args[0]), args[1], args[2], int(args[3]), mode, int(args[5]) if mode == "stop-server" else 0,
         float(args[6]) if mode == "stop-server" else 60.0)
