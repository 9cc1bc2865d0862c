"""The loop's side of generation: the RolloutGenerator interface and its clients (colocated engine, own-rank
replicas, rollout server), and the queue of requests in flight."""
