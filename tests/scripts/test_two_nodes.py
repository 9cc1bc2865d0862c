"""scripts/gpu/two_nodes.py's reading of nvidia-smi: a rank that took its GPU from RANK instead of LOCAL_RANK is
marked wrong in the table (the GPU run is where the device rule runs for real: docs/cluster.md)."""

from tests.helpers import load_script

two_nodes = load_script("scripts/gpu/two_nodes.py")

GPUS = "0, GPU-a\n1, GPU-b\n2, GPU-c\n3, GPU-d\n"
"""nvidia-smi --query-gpu=index,uuid --format=csv,noheader on a 4-GPU machine."""


def _env(rank: int, local: int, node: int) -> dict[str, str]:
    visible = "0,1" if node == 0 else "2,3"
    return {"RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(node), "CUDA_VISIBLE_DEVICES": visible}


def test_each_rank_on_its_machines_gpu_local_rank_is_ok():
    environs = {100: _env(0, 0, 0), 101: _env(1, 1, 0), 200: _env(2, 0, 1), 201: _env(3, 1, 1), 999: {"X": "1"}}
    apps = "100, GPU-a\n101, GPU-b\n200, GPU-c\n201, GPU-d\n999, GPU-d\n100, GPU-a\n"  # pid 999: another job's
    held = two_nodes.placement(apps, GPUS, environs)
    assert held == {0: {0}, 1: {1}, 2: {2}, 3: {3}}
    rows = two_nodes.rows("nccl", {int(e["RANK"]): e for e in environs.values() if "RANK" in e}, held)
    assert [(r["rank"], r["expected_gpu"], r["ok"]) for r in rows] == [(0, 0, True), (1, 1, True), (2, 2, True),
                                                                         (3, 3, True)]


def test_a_rank_on_the_wrong_gpu_or_on_two_is_marked_wrong():
    environs = {100: _env(0, 0, 0), 101: _env(1, 1, 0), 200: _env(2, 0, 1), 201: _env(3, 1, 1)}
    # machine 1's ranks both on its first GPU (one took RANK % 2 = 0 ... ), and rank 0 also on GPU 1
    apps = "100, GPU-a\n100, GPU-b\n101, GPU-b\n200, GPU-c\n201, GPU-c\n"
    held = two_nodes.placement(apps, GPUS, environs)
    rows = two_nodes.rows("colocated", {int(e["RANK"]): e for e in environs.values()}, held)
    assert [r["ok"] for r in rows] == [False, True, True, False]
    result = {"layout": "colocated", "exit_codes": [0, 1], "steps": 3, "median_step_s": 1.5, "placement": rows}
    text = two_nodes.table([result])
    assert "| colocated | no [0, 1] | 3 | 1.50 | 0 | 0 | 0 | 0, 1 **wrong** | 0 |" in text
    assert "|  |  |  |  | 3 | 1 | 1 | 2 **wrong** | 3 |" in text
