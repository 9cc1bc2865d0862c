"""A job on two machines, as far as one machine can show it: two launchers started as a user starts them on two hosts.

    python -m torchtitan_rl.launch --nnodes 2 --node-rank K --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT ...

Node 1 runs in namespaces of its own (``unshare``): another host name, so no rank can see a pid of the other machine
(run.exits.RankExits looks for dead peers on its own host only), and for the file-system test a private tmpfs over
job.output_dir, as on machines that share no disk. gloo on CPU carries what NCCL carries on GPUs. Each layout runs the
smallest job that shows it (cpu_tiny, 8 prompts, 3 steps); each fault is caused for real (kill -9 of a rank or of a
machine's launcher, Ctrl-C of a machine's launcher).
"""

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers import REPO, free_port, repo_env
from torchtitan_rl.distributed.process_group import local_device
from torchtitan_rl.run.parts import run_device
from torchtitan_rl.trainer import checkpoint

CPU_TINY = REPO / "run_configs" / "cpu_tiny.toml"
HOST1 = "node1"
"""Node 1's host name (its own UTS namespace)."""
TOKEN = "two-node-secret"
EXIT_S = 15.0
"""Every rank of both machines must be gone this long after a fault (a rank notices its launcher's death within
run.exits.ORPHAN_CHECK_S; a peer's socket error and the 2 s look for a dead peer follow)."""


def _namespaces() -> bool:
    return subprocess.run(["unshare", "--uts", "--mount", "true"], capture_output=True).returncode == 0


needs_namespaces = pytest.mark.skipif(not _namespaces(), reason="needs unshare (CAP_SYS_ADMIN) for a second 'host'")


def _node_cmd(k: int, port: int, nproc: int, out: Path, *extra: str, private: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "torchtitan_rl.launch", "--nnodes", "2", "--node-rank", str(k),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", str(nproc),
           # a host name that resolves (node1 does not): the rank-0 machine's store address goes to the others
           "--local-addr", "127.0.0.1",
           "-m", "torchtitan_rl.simple_grpo", "--config", str(CPU_TINY), "--job.output_dir", str(out),
           "--grpo.prompts_per_step", "8", *extra]
    if k == 0:
        return cmd
    mount = f"mount -t tmpfs none {out} && " if private else ""
    return ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
            f'hostname {HOST1} && {mount}exec "$@"', "sh", *cmd]


@contextmanager
def _two_nodes(out: Path, nproc: int, *extra: str, private: bool = False, env: dict | None = None):
    """Both machines' launchers (node 0 first); every process of theirs is gone after the block."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = repo_env(GLOO_SOCKET_IFNAME="lo", **(env or {}))
    procs = [subprocess.Popen(_node_cmd(k, port, nproc, out, *extra, private=private), cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for k in (0, 1)]
    ranks: list[psutil.Process] = []
    try:
        yield procs, ranks
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for rank in ranks:  # in sessions of their own (torchrun's agent starts them so)
            try:
                rank.kill()
            except psutil.NoSuchProcess:
                pass
        for proc in procs:
            proc.communicate()


def _ranks(procs: list[subprocess.Popen], nproc: int, ranks: list) -> dict[int, dict[str, str]]:
    """Wait for every machine's ranks; each rank's torchrun variables by its RANK (added to ``ranks``)."""
    deadline = time.monotonic() + 300
    while True:
        # A rank once its environment is torchrun's: node 1's `sh` first runs `hostname`, and a rank forked but not
        # yet exec'd still shows the launcher's environment.
        children = [[(kid, env) for kid in psutil.Process(p.pid).children() if "LOCAL_RANK" in (env := _environ(kid))]
                    for p in procs]
        if all(len(c) == nproc for c in children):
            break
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, [p.poll() for p in procs]
        time.sleep(0.2)
    found = {}
    for launcher, kids in enumerate(children):
        for kid, env in kids:
            ranks.append(kid)
            found[int(env["RANK"])] = {**{k: env[k] for k in ("LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE")},
                                       "launcher": launcher, "pid": kid.pid}
    return found


def _environ(process: psutil.Process) -> dict[str, str]:
    try:
        return process.environ()
    except psutil.NoSuchProcess:  # `hostname` ended
        return {}


def _finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str]]:
    """(exit code, stderr) of each machine's launcher."""
    stderrs = [p.communicate(timeout=timeout)[1] for p in procs]
    return [(p.returncode, stderr) for p, stderr in zip(procs, stderrs)]


def _our_lines(stderr: str) -> list[str]:
    """The job's lines: ours and any traceback or torchrun report (library warnings left out)."""
    return [line for line in stderr.splitlines()
            if line.startswith("torchtitan_rl:") or "Traceback" in line or "Error" in line]


def _wait_training(procs: list[subprocess.Popen], out: Path) -> None:
    deadline = time.monotonic() + 600
    metrics = out / "latest" / "metrics.jsonl"
    while not metrics.exists() or not metrics.read_text():
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, [p.poll() for p in procs]
        time.sleep(0.2)


def test_a_rank_takes_its_gpu_from_local_rank_not_rank(monkeypatch):
    """Rank 3 of two machines with 2 GPUs each is GPU 1 of the second machine: CPU tests cannot see it by running
    (every 'machine' here is one host whose ranks both have local rank 0)."""
    for name, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                        "GROUP_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    assert local_device("cuda") == torch.device("cuda", 1)
    assert local_device("cuda:0") == torch.device("cuda", 0)  # a device the config names is kept
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert run_device("cuda") == torch.device("cuda", 1)
    assert run_device("auto") == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="local rank 2 needs GPU 2, but 2 are visible"):
        run_device("cuda")


@needs_namespaces
@pytest.mark.slow  # two launchers, two engines: ~1 min on 2 cores
def test_colocated_on_two_machines_writes_one_run_folder_and_one_checkpoint(tmp_path):
    """Every rank trains and generates, one on each machine; rank 0 (node 0) alone writes the run folder, `latest`,
    the metrics and the plot; the checkpoint holds both ranks' shards, in one step folder that verifies."""
    out = tmp_path / "out"
    with _two_nodes(out, 1, "--trainer.steps", "3", "--trainer.checkpoint.enable",
                    "--trainer.checkpoint.interval", "2") as (procs, ranks):
        found = _ranks(procs, 1, ranks)
        ended = _finish(procs)
    assert [code for code, _ in ended] == [0, 0], [stderr[-3000:] for _, stderr in ended]
    assert {r: (v["LOCAL_RANK"], v["GROUP_RANK"]) for r, v in found.items()} == {0: ("0", "0"), 1: ("0", "1")}
    assert found[0]["launcher"] != found[1]["launcher"]
    for _, stderr in ended:
        assert not [line for line in _our_lines(stderr) if "Traceback" in line or "Error" in line], stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["latest", "run-1"]
    run = out / "run-1"
    assert (out / "latest").resolve() == run
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    assert len(list((run / "tensorboard").iterdir())) == 1
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-2"]
    step = run / "checkpoints" / "step-2"
    assert checkpoint.verify(step) is None
    assert {p.name for p in step.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}  # one shard file per rank
    assert not list(out.glob("error_rank*"))


@needs_namespaces
@pytest.mark.slow  # four processes, two engines: ~1-2 min on 2 cores
def test_generator_replicas_on_the_second_machine_over_the_nccl_transport(tmp_path):
    """Two trainer ranks on one machine, the two generator replicas (the last ranks) on the other; the weights cross
    machines in one broadcast per bucket (gloo here, NCCL on GPUs). Each replica is its machine's local rank 0 or 1."""
    out = tmp_path / "out"
    with _two_nodes(out, 2, "--trainer.steps", "3", "--weight_sync.transport", "nccl",
                    "--generator.parallelism.data_parallel_replicate_degree", "2") as (procs, ranks):
        found = _ranks(procs, 2, ranks)
        ended = _finish(procs)
    assert [code for code, _ in ended] == [0, 0], [stderr[-3000:] for _, stderr in ended]
    trainers, generators = {found[0]["launcher"], found[1]["launcher"]}, {found[2]["launcher"], found[3]["launcher"]}
    assert len(trainers) == len(generators) == 1 and trainers != generators
    assert {found[r]["LOCAL_RANK"] for r in (2, 3)} == {"0", "1"} and {found[r]["GROUP_RANK"] for r in (2, 3)} == {"1"}
    steps = (out / "latest" / "metrics.jsonl").read_text().splitlines()
    assert len(steps) == 3 and '"weight_version": 2' in steps[-1]


@needs_namespaces
@pytest.mark.slow  # a server and two launchers: ~1 min on 2 cores
def test_a_trainer_on_two_machines_trains_through_a_rollout_server(tmp_path):
    """The rollout server in its own process, the trainer's two ranks on two machines (FSDP across them); trainer
    rank 0 talks to the server."""
    port = free_port()
    env = {"TORCHTITAN_RL_SERVE_TOKEN": TOKEN}
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_rl.serve", "--config", str(CPU_TINY), "--job.output_dir",
         str(tmp_path / "server"), "--serve.port", str(port)],
        cwd=REPO, env=repo_env(**env), stdout=log, stderr=subprocess.STDOUT)
    try:
        out = tmp_path / "out"
        with _two_nodes(out, 1, "--trainer.steps", "3", "--weight_sync.transport", "server",
                        "--serve.port", str(port), env=env) as (procs, ranks):
            found = _ranks(procs, 1, ranks)
            ended = _finish(procs)
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    assert [code for code, _ in ended] == [0, 0], [stderr[-3000:] for _, stderr in ended]
    assert found[0]["launcher"] != found[1]["launcher"]
    assert len((out / "latest" / "metrics.jsonl").read_text().splitlines()) == 3
    assert "sync -> version 2" in (tmp_path / "server.log").read_text()


@needs_namespaces
@pytest.mark.slow  # two launchers, two engines, then the fault: ~1 min on 2 cores
@pytest.mark.parametrize("fault", ["kill_rank_on_node_1", "kill_launcher_of_node_1", "ctrl_c_on_node_0"])
def test_a_fault_on_one_machine_ends_the_job_on_both_with_one_line_each(tmp_path, fault):
    out = tmp_path / "out"
    with _two_nodes(out, 1, "--trainer.steps", "500") as (procs, ranks):
        found = _ranks(procs, 1, ranks)
        _wait_training(procs, out)
        node1 = next(v for v in found.values() if v["launcher"] == 1)
        t0 = time.monotonic()
        if fault == "kill_rank_on_node_1":
            os.kill(node1["pid"], signal.SIGKILL)
        elif fault == "kill_launcher_of_node_1":
            procs[1].kill()
        else:
            os.killpg(procs[0].pid, signal.SIGINT)
        _, alive = psutil.wait_procs(ranks, timeout=EXIT_S)
        ended_s = time.monotonic() - t0
        assert not alive, f"{fault}: ranks {[p.pid for p in alive]} still running after {EXIT_S} s"
        ended = _finish(procs, timeout=60)
    lines = [_our_lines(stderr) for _, stderr in ended]
    print(f"{fault}: every rank ended {ended_s:.1f} s after the fault; node 0 {lines[0]}; node 1 {lines[1]}")
    for node, (code, stderr) in enumerate(ended):
        assert len(lines[node]) == 1 and lines[node][0].startswith("torchtitan_rl: "), f"node {node}: {stderr[-3000:]}"
    rank1 = next(r for r, v in found.items() if v["launcher"] == 1)
    if fault == "kill_rank_on_node_1":  # its launcher says it; node 0's rank lost its peer
        assert lines[1][0].startswith(f"torchtitan_rl: rank {rank1} (pid {node1['pid']}) was killed by SIGKILL")
    elif fault == "kill_launcher_of_node_1":  # nobody else would stop its rank: it notices and says it
        assert lines[1][0].startswith(f"torchtitan_rl: rank {rank1}'s launcher (pid {procs[1].pid}) died")
    else:  # node 0's launcher got the signal; node 1 says the job's line, or that node 0's launcher is gone
        assert lines[0][0] == "torchtitan_rl: interrupted (SIGINT)", lines[0]
        assert ("interrupted (SIGINT)" in lines[1][0]
                or "the machine whose launcher held it ended or died" in lines[1][0]), lines[1]
    assert all(code != 0 for code, _ in ended)


@needs_namespaces
@pytest.mark.slow  # two launchers' start-up (imports, rendezvous): ~30-45 s on 2 cores
def test_checkpoints_across_machines_without_a_shared_file_system_are_refused_in_one_line(tmp_path):
    """Node 1 sees a private tmpfs at job.output_dir: DCP would write its shards where rank 0 never reads them. Both
    machines end at start with the same line (node 0's rank says it, node 1's launcher echoes it), and the empty run
    folder is gone."""
    out = tmp_path / "out"
    with _two_nodes(out, 1, "--trainer.steps", "3", "--trainer.checkpoint.enable", private=True) as (procs, _):
        ended = _finish(procs)
    lines = [_our_lines(stderr) for _, stderr in ended]
    for node_lines, (code, stderr) in zip(lines, ended):
        assert len(node_lines) == 1, stderr[-3000:]
        assert "trainer.checkpoint.enable: every trainer rank writes its shards" in node_lines[0], node_lines[0]
        assert f"rank 1 on {HOST1} cannot see it" in node_lines[0] and "docs/cluster.md" in node_lines[0]
        assert code == 2
    assert lines[0] == lines[1]
    assert list(out.iterdir()) == []  # node 0's view: no run-1 left behind


def _alone(tmp_path: Path, port: int, *extra: str) -> subprocess.Popen:
    """Machine 0's launcher of a two-machine job whose machine 1 never comes."""
    cmd = _node_cmd(0, port, 1, tmp_path / "out")
    cmd[cmd.index("--nproc-per-node"):cmd.index("--nproc-per-node")] = list(extra)
    return subprocess.Popen(cmd, cwd=REPO, env=repo_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.slow  # torchrun's join timeout of 3 s in a whole process: ~7 s, out of the quick loop
def test_a_machine_that_never_comes_ends_the_rendezvous_in_one_line(tmp_path):
    proc = _alone(tmp_path, free_port(), "--rdzv-conf", "join_timeout=3")
    _, stderr = proc.communicate(timeout=300)
    assert _our_lines(stderr) == [f"torchtitan_rl: rendezvous at {proc.args[proc.args.index('--rdzv-endpoint') + 1]}: "
                                  "not every machine came within torchrun's join timeout (--rdzv-conf "
                                  "join_timeout=SECONDS, default 600); this machine's ranks stopped (every machine "
                                  "runs the same --rdzv-endpoint and --nnodes: docs/cluster.md)"], stderr[-3000:]
    assert proc.returncode == 1


def test_ctrl_c_while_waiting_for_the_other_machine_is_one_line_exit_130(tmp_path):
    port = free_port()
    proc = _alone(tmp_path, port)
    try:
        deadline = time.monotonic() + 120
        while True:  # the launcher holds the rendezvous store: it waits for machine 1
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert _our_lines(stderr) == ["torchtitan_rl: interrupted (SIGINT)"], stderr[-3000:]
    assert proc.returncode == 130
