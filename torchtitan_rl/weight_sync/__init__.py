from torchtitan_rl.weight_sync.nccl import NcclReceiver, NcclSender, World, init_world
from torchtitan_rl.weight_sync.plan import Destination, SyncPlan, build_plan
from torchtitan_rl.weight_sync.sync import SyncStats, WeightSync

__all__ = [
    "Destination", "NcclReceiver", "NcclSender", "SyncPlan", "SyncStats", "WeightSync", "World", "build_plan",
    "init_world",
]
