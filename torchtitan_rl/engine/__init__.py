"""vLLM in this process running torchtitan's decoder: the Engine (gated until the first sync, sleep, LoRA), its
in-process build, the vLLM model adapter, and the Rollouts it returns."""
