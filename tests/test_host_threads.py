"""Each process of a run takes its share of the host's cores (job.host_threads, distributed/threads.py), read inside
each rank of a real two-process run while it trains."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, free_port
from torchtitan_rl.distributed.threads import TORCHRUN_OMP, host_threads, intra_op_threads, usable_cpus
from torchtitan_rl.grpo.tasks.digits import DigitsTask


def test_the_cores_are_split_among_the_processes_sharing_them():
    assert host_threads(0, cpus=16, local_ranks=2, host_gpus=0, environ={}) == 8
    assert host_threads(0, cpus=16, local_ranks=1, host_gpus=2, environ={}) == 8  # two one-GPU runs on a 2-GPU host
    assert host_threads(0, cpus=16, local_ranks=4, host_gpus=2, environ={}) == 4  # the larger count of the two
    assert host_threads(0, cpus=2, local_ranks=3, host_gpus=0, environ={}) == 1  # never 0
    assert host_threads(0, cpus=16, local_ranks=2, host_gpus=0, environ={"OMP_NUM_THREADS": "3"}) == 3  # the user's
    assert host_threads(0, cpus=16, local_ranks=2, host_gpus=0, environ={"OMP_NUM_THREADS": "x"}) == 8
    assert host_threads(5, cpus=16, local_ranks=2, host_gpus=0, environ={"OMP_NUM_THREADS": "3"}) == 5  # the field's
    assert host_threads(-1, cpus=16, local_ranks=2, host_gpus=0, environ={}) is None  # defaults left alone
    # torchrun's 1 under torchtitan_rl.launch (which marks it) is not the user's
    assert host_threads(0, cpus=16, local_ranks=2, host_gpus=0, environ={"OMP_NUM_THREADS": "1", TORCHRUN_OMP: "1"}) == 8


class RecordThreads(DigitsTask):
    """The digits task; each rank's first reward writes the threads its process runs with to $THREADS_OUT."""

    def __init__(self) -> None:
        super().__init__(mode="copy")
        self.said = False

    def reward(self, prompt, completion_ids):
        if not self.said:
            self.said = True
            Path(os.environ["THREADS_OUT"], f"rank{os.environ['RANK']}.json").write_text(json.dumps({
                "torch": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
                "inductor": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"),
                "torchrun_omp": os.environ.get(TORCHRUN_OMP),
            }))
        return super().reward(prompt, completion_ids)


def record_threads() -> RecordThreads:
    return RecordThreads()


@pytest.mark.slow  # two engines and two trainers on the machine's cores: ~40 s
def test_the_engine_loop_runs_on_its_own_thread_count_and_gives_the_process_its_own_back():
    before = torch.get_num_threads()
    with intra_op_threads(1):  # generator.loop_threads on a GPU engine
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), intra_op_threads(1):
        raise RuntimeError("a failed generate")
    assert torch.get_num_threads() == before
    with intra_op_threads(0):  # 0, and every CPU engine: the process's count
        assert torch.get_num_threads() == before


@pytest.mark.slow  # a two-rank run with an engine each: ~18 s
def test_each_rank_of_a_two_process_run_takes_half_the_cores(tmp_path):
    """Two ranks started by torchtitan_rl.launch with no OMP_NUM_THREADS: torchrun's agent gives each rank
    OMP_NUM_THREADS=1 (a 30B run's CPU optimizer then ran on one core per rank); left to torch, each would run a
    thread per core of the host. Each takes half instead, vLLM's engine built in the same process keeps it, and the
    run's compile workers are told the same."""
    out = tmp_path / "threads"
    out.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS", TORCHRUN_OMP)}
    env.update(PYTHONPATH=str(REPO), THREADS_OUT=str(out))
    cmd = [sys.executable, "-m", "torchtitan_rl.launch", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "torchtitan_rl.simple_grpo", "--config", str(REPO / "run_configs" / "cpu_tiny.toml"),
           "--job.output_dir", str(tmp_path / "run"), "--trainer.steps", "1", "--grpo.prompts_per_step", "4",
           "--grpo.task", "tests.test_host_threads:record_threads"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    share = max(1, usable_cpus() // 2)
    for rank in range(2):
        got = json.loads((out / f"rank{rank}.json").read_text())
        # On a 2-core machine the share is torchrun's 1 too: the mark says the rank did not take it as the user's.
        assert got == {"torch": share, "omp": str(share), "inductor": str(share), "torchrun_omp": "1"}, (rank, got)


def test_a_user_setting_is_kept(tmp_path):
    """OMP_NUM_THREADS set by the user (or plain torchrun) wins over the share; job.host_threads -1 leaves torch
    alone."""
    # One process for the three cases (an import of torch each would be seconds): -1 first, while torch is untouched.
    code = ("import os, torch\n"
            "from torchtitan_rl.distributed.threads import set_host_threads\n"
            "for setting, omp in ((-1, None), (0, '1'), (2, '1')):\n"
            "    if omp:\n"
            "        os.environ['OMP_NUM_THREADS'] = omp\n"
            "    print(set_host_threads(setting, device_type='cpu'), torch.get_num_threads(),"
            " os.environ.get('OMP_NUM_THREADS'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", TORCHRUN_OMP)}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    untouched, user, field = (line.split() for line in proc.stdout.splitlines())
    assert untouched[0] == "None" and untouched[2] == "None", untouched  # torch's own default, no variable set
    assert user == ["1", "1", "1"]  # the user's OMP_NUM_THREADS wins over the share
    assert field == ["2", "2", "2"]  # job.host_threads N wins over both
