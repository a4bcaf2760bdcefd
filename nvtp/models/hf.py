"""Hugging Face causal LMs built from a config (nothing is downloaded). Needs transformers
(``uv sync`` installs it with the dev group; ``pip install nvtp[hf]``).

* Small ones (random init, seeded), for ``nvtp demo --model llama`` and ``tools/train_hf.py``.
* Published configurations built on the meta device (no weights are allocated), to plan before
  renting the machines::

      nvtp explain --module nvtp.models.hf:llama3_70b --plan megatron-sp --devices 8
      nvtp explain --module nvtp.models.hf:qwen2_72b --plan megatron-sp --devices 8

  Each factory returns ``(model, args, kwargs)``: the model in bf16 on the meta device and a
  training call at sequence 4096, batch 1 (``input_ids``, ``labels``).
"""

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
    # interleaved rotary embeddings (x[..., ::2], x[..., 1::2]): strided slices (nvtp/frontend/strided.py)
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=64, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=64, rotary_dim=8,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(n_embd=64, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=64,
                                                            n_ctx=64, rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "cohere": ("CohereConfig", "CohereForCausalLM", {**_SMALL, "pad_token_id": 0}),
}


def _transformers():
    """transformers, or an ImportError that says how to install it."""
    try:
        import transformers  # optional: transformers (pip install nvtp[hf])
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


# Published configurations (the config.json of the released checkpoints; only what shapes the program).
PUBLISHED = {
    "llama3-70b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
        vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)),
    "qwen2-72b": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, intermediate_size=29568,
        vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False,
        use_sliding_window=False)),
}


def on_meta(name: str, *, layers: int | None = None, seq: int = 4096, batch: int = 1,
            dtype: torch.dtype = torch.bfloat16) -> tuple[torch.nn.Module, tuple, dict]:
    """``PUBLISHED[name]`` built on the meta device in ``dtype`` (``layers``: cut to that many decoder
    layers), and a training call: ``(model, (input_ids,), {"labels": input_ids})`` of ``[batch, seq]``."""
    transformers = _transformers()
    config_cls, model_cls, kwargs = PUBLISHED[name]
    kwargs = dict(kwargs, **({"num_hidden_layers": layers} if layers is not None else {}))
    config = getattr(transformers, config_cls)(**kwargs, use_cache=False)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config).to(dtype)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def llama3_70b() -> tuple[torch.nn.Module, tuple, dict]:
    """Llama 3 70B (80 layers, hidden 8192, 64 heads, 8 KV heads) on the meta device, sequence 4096."""
    return on_meta("llama3-70b")


def qwen2_72b() -> tuple[torch.nn.Module, tuple, dict]:
    """Qwen2 72B (80 layers, hidden 8192, 64 heads, 8 KV heads, q/k/v biases) on the meta device, sequence 4096."""
    return on_meta("qwen2-72b")
