"""Every causal-LM family of transformers' ``AutoModelForCausalLM`` through nvtp, one fresh process each.

    python tools/hf_families.py --family llama            # one family here: a JSON line
    python tools/hf_families.py --all --out sweep.jsonl   # every family, each in a fresh process
    python tools/hf_families.py --table sweep.jsonl       # the table of docs/hf.md

A family is built from a tiny config (hidden 64, 4 heads, 2 KV heads, 2 layers, vocabulary 256,
fp32, seeded, dropout 0; every size the config's constructor names, nothing downloaded; multi-head latent
attention's sizes and ties for a config that names ``kv_lora_rank``, ``MLA``; a few families' own sizes, ``FAMILY``) with the
model class ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` gives; one that does not build on the CPU, or
whose tiny config still builds more than ``MAX_PARAMETERS`` (sub-configs, such as Fuyu's
``text_config``, keep their full sizes), is recorded as ``no tiny build``. Then ``nvtp.jit(model, plan="megatron")`` on a simulated mesh of 2
(ranks as threads), called ``model(input_ids, labels=input_ids)``, is checked against the eager
model on one process as ``tests/test_hf.py`` checks it (loss and logits within 1e-5, every
gradient within 1e-4). One process per family: TorchDynamo's recompile limit makes later models
fall back silently in one process (docs: /work/shared/ENVIRONMENT.md), and a crash stays its own.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # constructor argument -> its tiny value, for whichever names a config uses
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64, "embed_dim": 64, "hidden_dim": 64,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2, "multi_query_group_num": 2,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "d_ff": 128, "ffn_hidden_size": 128, "decoder_ffn_dim": 128,
    "vocab_size": 256, "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "max_seq_len": 64,
    "head_dim": 16, "rotary_dim": 8, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "use_cache": False, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "tie_word_embeddings": False,
}
# Multi-head latent attention (DeepSeek-V2/V3 and the families built on it; a config that names ``kv_lora_rank``): the
# latent ranks and per-head dimensions, whose full defaults (rope 64, nope 128, v 128, kv rank 512) do not fit 4 heads of
# 16. Set only where the config's own default is a size: a None (Kimi-Linear's q_lora_rank: no query compression) stays.
MLA = {
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,  # DeepSeek-V3.2's sparse-attention indexer
}
# size -> the size an MLA config's defaults may tie it to; where they do (the default values are equal), the tiny config
# keeps the tie: head_dim is the rotary width qk_rope_head_dim (LongCat-Flash's rotary embedding is head_dim wide, its
# keys' rotary part qk_rope_head_dim), and one key and value head per query head (DeepSeek-V3.2's indexer mask).
MLA_TIES = {"head_dim": "qk_rope_head_dim", "num_key_value_heads": "num_attention_heads"}
# DeepSeek-V3's grouped routing (n_group groups of experts, the best topk_group of them) with 4 experts: 2 groups of 2.
GROUPS = {"n_group": 2, "topk_group": 1}
# family -> sizes of its own that the tiny sizes above leave inconsistent (each config's validator says so)
FAMILY = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one global and one local layer: 2 (24 by default)
    "mamba2": {"expand": 1, "n_groups": 1},  # hidden_size * expand must equal num_heads * head_dim (64)
    "zaya": {"num_experts_per_tok": 1},  # "ZAYA currently supports num_experts_per_tok=1 only"
    "dots1": {"n_shared_experts": 1},  # its default None, which the model multiplies
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # its default None, which the model indexes
    # the last 15 layers (of 2) would reuse earlier layers' keys and values; per-layer embeddings of 262144 tokens
    "gemma3n_text": {"num_kv_shared_layers": 0, "vocab_size_per_layer_input": 256},
}


# Tiny builds have under 30M parameters but Gemma 4 text (135M: per-layer embeddings) and GIT (86M); Fuyu, BLT and
# Mllama keep full-size sub-configs (4.6G-9.8G: the process was killed for memory), Phi-4 multimodal 870M.
MAX_PARAMETERS = 300_000_000


def families() -> list[tuple[str, str]]:
    """(model type, class name) of every entry of transformers' causal-LM mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())


def not_decoder_only(model_type: str, class_name: str) -> str:
    """Why a family is no decoder-only language model ("" if it is one): an encoder-decoder's
    decoder, an encoder used as a decoder (BERT-like: ``is_decoder`` set by hand), or a multimodal
    model (``...ForConditionalGeneration``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "ConditionalGeneration" in class_name:
        return "multimodal (ForConditionalGeneration)"
    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - a config that needs arguments: let the check say
        return ""
    if getattr(config, "is_encoder_decoder", False):
        return "the decoder of an encoder-decoder model"
    if hasattr(config, "is_decoder") and "is_decoder" in vars(config) and not config.is_decoder and \
            "add_cross_attention" in vars(config) and model_type not in ("gpt2", "gpt-sw3", "gpt_bigcode", "openai-gpt", "ctrl"):
        return "an encoder, a decoder only with is_decoder=True"
    return ""


def build(model_type: str, class_name: str):
    """The family's model from a tiny config (see the module docstring), seeded."""
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    params = inspect.signature(config_cls.__init__).parameters
    sizes = tiny_sizes(config_cls) | FAMILY.get(model_type, {})
    kwargs = {k: v for k, v in sizes.items() if k in params}
    kwargs |= {k: 0.0 for k in params if "dropout" in k or "pdrop" in k}
    config = config_cls(**kwargs)
    for k, v in sizes.items():  # a config that takes its sizes as **kwargs
        if k not in params and hasattr(config, k) and isinstance(getattr(config, k), type(v)) and k not in ("dim",) \
                and not isinstance(getattr(type(config), k, None), property):  # a derived size (Falcon's head_dim)
            setattr(config, k, v)
    model_cls = getattr(transformers, class_name)
    try:
        with torch.device("meta"):  # nothing allocated: a config that stays large is refused, not run out of memory
            count = sum(p.numel() for p in model_cls(config).parameters())
    except Exception:  # noqa: BLE001 - a model that does not build on meta: the real build says
        count = 0
    if count > MAX_PARAMETERS:
        subs = [k for k, v in vars(config).items() if hasattr(v, "to_dict") and not k.startswith("_")]
        raise ValueError(f"the tiny config still builds {count / 1e6:.0f}M parameters (sub-configs the tool does not shrink: "
                         f"{', '.join(subs) or 'none'})")
    torch.manual_seed(0)
    return model_cls(config)


def tiny_sizes(config_cls) -> dict:
    """Constructor argument or attribute -> its tiny value, for ``config_cls``: ``SIZES``; for an MLA config (one that
    names ``kv_lora_rank``) also ``MLA`` where the config's default is not None, the ties of ``MLA_TIES`` its
    defaults hold, and ``GROUPS`` where its default routes over more than one group. Ensures every tie and size
    is read from the config's own defaults (its constructor's signature, or the config built with no arguments)."""
    params = inspect.signature(config_cls.__init__).parameters
    default = _default(config_cls)

    def default_of(name):  # the default config's value, else the constructor's default; None for neither
        try:
            return getattr(default, name)
        except Exception:  # noqa: BLE001 - no such attribute, or one per layer (Dots 3 Note's num_key_value_heads)
            return params[name].default if name in params and params[name].default is not inspect.Parameter.empty else None

    sizes = dict(SIZES)
    if default_of("kv_lora_rank") is None:
        return sizes
    sizes |= {k: v for k, v in MLA.items() if default_of(k) is not None}
    sizes |= {k: sizes[tie] for k, tie in MLA_TIES.items() if default_of(k) is not None and default_of(k) == default_of(tie)}
    if (default_of("n_group") or 1) > 1:
        sizes |= GROUPS
    return sizes


def _default(config_cls):
    """``config_cls`` with its defaults, or None where it needs arguments."""
    try:
        return config_cls()
    except Exception:  # noqa: BLE001 - a config that needs arguments: no default to compare with
        return None


def check(model_type: str, class_name: str) -> dict:
    """One family's record: family, class, route, result ("PASS", "FAIL", "no tiny build"), error, seconds."""
    import torch

    sys.path.insert(0, str(ROOT))
    from tests.test_hf import Mesh

    start = time.perf_counter()
    record = {"family": model_type, "class": class_name, "route": "", "result": "", "error": ""}
    try:
        model = build(model_type, class_name)
        idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        runs_eagerly(model, idx)
    except Exception as e:  # noqa: BLE001 - any failure to build or run eagerly: not a tiny CPU build
        record.update(result="no tiny build", error=_line(e))
        return record | {"seconds": round(time.perf_counter() - start, 1)}
    try:
        mesh = Mesh(model, 2, "megatron", idx, labels=idx)
        record["route"] = mesh.ranks[0].last.traced.route
        worst = parity(model, mesh, idx)
        record.update(result="PASS", error="", worst={k: float(v) for k, v in worst.items()}, how=mesh.ranks[0].last.traced.how[:120])
    except Exception as e:  # noqa: BLE001 - the record says what failed
        record.update(result="FAIL", error=f"{type(e).__name__}: {_line(e)}")
    return record | {"seconds": round(time.perf_counter() - start, 1)}


def runs_eagerly(model, idx) -> None:
    """Run ``model(idx, labels=idx)`` eagerly on a copy (raises what eager raises), leaving ``model`` as built: a
    forward may leave state on the model (RecurrentGemma keeps its last recurrent state, a tensor with autograd
    history, as an attribute), which ``copy.deepcopy`` refuses ("Only Tensors created explicitly by the user
    (graph leaves) support the deepcopy protocol"), and the ranks and the eager reference are copies of it."""
    copy.deepcopy(model)(idx, labels=idx)


def parity(model, mesh, idx) -> dict:
    """``tests/test_hf.py``'s check, with gradients compared against the model's gradient scale: a
    gradient that is zero in exact arithmetic (a key projection's bias: softmax ignores a constant
    added to every score of a row) is rounding noise in eager and in nvtp alike, whose relative
    error means nothing. Loss and logits within 1e-5, every gradient within 1e-4 of the larger of its
    own size and 1e-3 of the largest gradient (relative, in the 2-norm)."""
    import copy

    from nvtp.dump import relative_error

    def step(m):
        out = m(idx, labels=idx)
        out.loss.backward()
        return out

    outs = mesh.run(step)
    ref = copy.deepcopy(model)
    want = ref(idx, labels=idx)
    want.loss.backward()
    worst = {"loss": 0.0, "logits": 0.0, "grad": 0.0}
    for out in outs:
        worst["loss"] = max(worst["loss"], relative_error(out.loss.detach(), want.loss.detach())[0])
        worst["logits"] = max(worst["logits"], relative_error(out.logits.detach(), want.logits.detach())[0])
    if worst["loss"] > 1e-5 or worst["logits"] > 1e-5:
        raise AssertionError(f"loss or logits differ from eager: {worst}")
    scale = max(float(p.grad.norm()) for p in ref.parameters() if p.grad is not None)
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        got = mesh.whole_grad(name, p.shape)
        err = float((got.double() - p.grad.double()).norm()) / max(float(p.grad.norm()), 1e-3 * scale)
        if err > 1e-4:
            raise AssertionError(f"the gradient of {name} differs from eager by {err:.2g} (relative)")
        worst["grad"] = max(worst["grad"], err)
    worst["split"] = sum(1 for n, _ in ref.named_parameters() if str(mesh.ranks[0].placement(n)) != "R")
    return worst


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    return line if len(line) <= 300 else line[:300] + " ..."


def run_all(out: Path, timeout: float, only: list[str] | None = None) -> None:
    """Every family in a fresh process, one after another, each record appended to ``out``."""
    done = {json.loads(line)["family"] for line in out.read_text().splitlines()} if out.exists() else set()
    for model_type, class_name in families():
        if model_type in done or (only and model_type not in only):
            continue
        why = not_decoder_only(model_type, class_name)
        if why:
            with out.open("a") as f:
                f.write(json.dumps({"family": model_type, "class": class_name, "route": "", "result": "not decoder-only", "error": why}) + "\n")
            continue
        cmd = [sys.executable, str(Path(__file__)), "--family", model_type]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            record = json.loads(lines[-1]) if lines else {
                "family": model_type, "class": class_name, "route": "", "result": "FAIL",
                "error": f"the process exited {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:300]}"}
        except subprocess.TimeoutExpired:
            record = {"family": model_type, "class": class_name, "route": "", "result": "FAIL", "error": f"timed out after {timeout:.0f} s"}
        record.setdefault("seconds", round(time.perf_counter() - start, 1))
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"{model_type:28s} {record['result']:14s} {record.get('error', '')[:120]}", flush=True)


def table(path: Path) -> str:
    """The markdown table of a sweep's records."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    out = ["| family | class | route | result | error |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["family"]):
        err = r.get("error", "").replace("|", "\\|")
        out.append(f"| {r['family']} | {r['class']} | {r.get('route', '')} | {r['result']} | {err[:160]} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family")
    p.add_argument("--all", action="store_true")
    p.add_argument("--only", nargs="*")
    p.add_argument("--out", type=Path, default=Path("hf_families.jsonl"))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--table", type=Path)
    args = p.parse_args()
    if args.table:
        print(table(args.table))
        return 0
    if args.family:
        names = dict(families())
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        print(json.dumps(check(args.family, names[args.family])))
        return 0
    if args.all or args.only:
        run_all(args.out, args.timeout, args.only)
        return 0
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
