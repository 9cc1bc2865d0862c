from torchtitan_rl.weight_sync.plan import Destination, SyncPlan, build_plan
from torchtitan_rl.weight_sync.sync import SyncStats, WeightSync

__all__ = ["Destination", "SyncPlan", "SyncStats", "WeightSync", "build_plan"]
