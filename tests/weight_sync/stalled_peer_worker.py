"""torchrun worker (2 ranks): the weight group's collectives time out after ``weight_timeout_s``.

init_world(weight_timeout_s=argv[1]); the generator rank then stalls (alive, its
socket open, silent) while trainer rank 0 waits in a broadcast from it. Trainer
rank 0 prints how long it waited and exits 0 if the group gave up.
"""

import sys
import time
from datetime import timedelta

import torch

from torchtitan_rl.distributed.world import broadcast, init_world


def main() -> None:
    world = init_world("cpu", replicas=1, weight_timeout_s=float(sys.argv[1]))
    if world.role == "generator":
        world.store.wait(["done"], timedelta(seconds=120))  # stalled: never joins the broadcast
        return
    started = time.monotonic()
    try:
        broadcast(world.group, torch.zeros(4), root=1).wait()
        print("the broadcast completed", flush=True)
        code = 1
    except RuntimeError as e:
        print(f"gave up after {time.monotonic() - started:.1f} s: {str(e).splitlines()[0]}", flush=True)
        code = 0
    world.store.set("done", "1")
    sys.exit(code)


if __name__ == "__main__":
    main()
