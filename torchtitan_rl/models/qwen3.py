"""The Qwen3 family: Qwen3ForCausalLM checkpoints, and Qwen3 shapes by name.

torchtitan's Qwen3 decoder as torchtitan defines it: QK-norm on, HF names
mapped by torchtitan's Qwen3StateDictAdapter (models/families.py).
"""

from torchtitan_rl.models.shape import Family, ModelShape
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

QWEN3 = Family(
    name="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    qk_norm=True,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    state_dict_adapter=Qwen3StateDictAdapter,
    hf_config_extra={"use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0},
)


def _shape(**fields) -> ModelShape:
    return ModelShape(family=QWEN3, rope_theta=QWEN3.rope_theta, rms_norm_eps=QWEN3.rms_norm_eps, **fields)


FLAVORS: dict[str, ModelShape] = {
    # ~0.1M parameters: learns the embedded digit task on 2 CPU cores in minutes.
    "tiny": _shape(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=192,
        vocab_size=0, max_position_embeddings=512, tie_word_embeddings=True,
    ),
    "debugmodel": _shape(
        hidden_size=256, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=3072,
        vocab_size=2048, max_position_embeddings=4096, tie_word_embeddings=True,
    ),
    "0.6B": _shape(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=3072,
        vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
    ),
    "1.7B": _shape(
        hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=6144,
        vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
    ),
    "4B": _shape(
        hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=9728,
        vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
    ),
    "8B": _shape(
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=12288,
        vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
    ),
}
