"""Small Hugging Face causal LMs built from a config (random init, seeded; nothing is
downloaded), for ``nvtp demo --model llama`` and ``tools/train_hf.py``. Needs transformers
(``uv sync`` installs it with the dev group; ``pip install nvtp[hf]``)."""

from __future__ import annotations

import torch

SEQ, BATCH, VOCAB = 16, 2, 256
_SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB, intermediate_size=128)
CONFIGS = {  # family -> (config class, model class, config): hidden 64, 4 heads, 2 layers, vocabulary 256, fp32
    "llama": ("LlamaConfig", "LlamaForCausalLM", _SMALL),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=64,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", _SMALL),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _SMALL),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_SMALL, "pad_token_id": 0}),  # fused qkv_proj of unequal parts (q 64 | k 32 | v 32)
}


def _transformers():
    """transformers, or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError:
        raise ImportError("transformers is not installed; run `uv sync` (dev group) or `pip install nvtp[hf]`") from None
    return transformers


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """The small ``family`` causal LM (fp32, without dropout), seeded."""
    transformers = _transformers()
    config_cls, model_cls, kwargs = CONFIGS[family]
    config = getattr(transformers, config_cls)(**kwargs, use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config)


def batch(step: int) -> torch.Tensor:
    """Step ``step``'s token batch ([BATCH, SEQ]; the model shifts them for the labels)."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def split_sizes(family: str) -> dict[str, int]:
    """The sizes a Megatron plan splits over the devices: heads, KV heads and the vocabulary."""
    kwargs = CONFIGS[family][2]
    heads = kwargs.get("num_attention_heads", kwargs.get("n_head"))
    return {"heads": heads, "KV heads": kwargs.get("num_key_value_heads", heads), "vocabulary": kwargs.get("vocab_size")}
