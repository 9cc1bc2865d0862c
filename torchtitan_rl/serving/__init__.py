"""The generator side in a process of its own: the HTTP rollout server (OpenAI-style API, sync sessions, signed
control messages) and the own-rank replica that answers a trainer through the job's store."""
