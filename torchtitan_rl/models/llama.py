"""The Llama family: LlamaForCausalLM checkpoints (SmolLM2; Llama 2, 3, and 3.1/3.2 with their RoPE scaling).

The same decoder as Qwen3 without QK-norm. torchtitan's Qwen3 blocks use
cos/sin RoPE in HF's rotate-half convention, which is Llama's too, so HF's
q/k weights load unpermuted (torchtitan's own llama3 model uses complex RoPE
and permutes them). HF Llama names are Qwen3's without q_norm/k_norm, so
torchtitan's Qwen3StateDictAdapter maps them (models/families.py).
"""

from torchtitan_rl.models.shape import Family, ModelShape
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

LLAMA = Family(
    name="llama",
    hf_architecture="LlamaForCausalLM",
    model_type="llama",
    qk_norm=False,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,  # LlamaConfig's default (Llama 2/3 and SmolLM2 checkpoints say 1e-5)
    state_dict_adapter=Qwen3StateDictAdapter,  # HF Llama names are Qwen3's minus q_norm/k_norm
    hf_config_extra={"mlp_bias": False, "pretraining_tp": 1, "attention_dropout": 0.0},
)


def _shape(**fields) -> ModelShape:
    return ModelShape(family=LLAMA, **fields)


FLAVORS: dict[str, ModelShape] = {
    # The tiny Qwen3's size as a Llama, for CPU tests.
    "tiny-llama": _shape(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=192,
        vocab_size=0, max_position_embeddings=512, tie_word_embeddings=True,
        rope_theta=100_000.0, rms_norm_eps=1e-5,
    ),
    # SmolLM2-135M(-Instruct)'s shape, random weights (real ones: model.hf_checkpoint).
    "smollm2-135m": _shape(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, intermediate_size=1536,
        vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
        rope_theta=100_000.0, rms_norm_eps=1e-5,
    ),
}
