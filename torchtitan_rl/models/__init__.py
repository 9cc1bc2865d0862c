"""What a model is: the families (Qwen3, Llama), their shapes, LoRA, and their HF folders (checks, weights)."""
