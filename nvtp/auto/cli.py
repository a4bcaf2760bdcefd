"""``nvtp explain --plan auto``: the plan nvtp chooses for a model on N devices, and the table it chose from.

    nvtp explain --plan auto --devices 64 --model nanogpt --config gpt3 --machine h100-ib --memory 80GB
    nvtp explain --plan auto --devices 4 --module pkg.mod:factory --json

The model is built on the meta device (nothing is allocated or computed): nvtp's GPT from
``--config`` / ``--layers`` / ``--batch`` (the whole step's batch: ``plan="auto"`` splits it), or
``--module``'s factory, whose example arguments are the whole batch. What is refused before
anything is traced: a mesh instead of a device count, the options ``plan="auto"`` chooses itself,
a budget that is not a size, a device count no layout takes, a budget nothing fits.
"""

from __future__ import annotations

import json
from typing import Any
from dataclasses import replace

import torch

from nvtp.errors import EXIT_OK, Usage
from nvtp.auto.search import machine_of, parse_memory, search
from nvtp.models import gpt

TAKEN = ("command", "fn", "file", "plan", "devices", "machine", "memory", "backend", "json", "model", "config", "layers", "batch",
         "module")  # what --plan auto reads; any other option it chooses itself


def explain_auto(args: Any, defaults: dict[str, Any], backend: str, load_module: Any) -> int:
    """Print the choice for ``args`` (``nvtp explain``'s parsed arguments) on ``backend``;
    ``defaults``: the arguments as parsed with no option given; ``load_module``: the CLI's
    ``--module`` loader (returns model, example_args, example_kwargs)."""
    given = [f"--{k.replace('_', '-')}" for k, v in vars(args).items() if k not in TAKEN and v != defaults.get(k)]
    if given:
        raise Usage(f"--plan auto chooses the mesh and its options itself: leave out {', '.join(given)} "
                    "(or give a plan, megatron or megatron-sp, with them)")
    if args.devices is None:
        raise Usage("--plan auto plans for a number of devices: give --devices N")
    machine = machine_of(args.machine, backend)  # unknown names and bad budgets refused before the model is built
    memory = parse_memory(args.memory, machine)
    if args.module:
        model, example, kwargs = load_module(args.module)
        name = args.module
    else:
        model, example, kwargs, name = _gpt(args)
    choice = search(model, tuple(example), kwargs, devices=args.devices, machine=machine, memory=memory, backend=backend,
                    model_name=name)
    print(json.dumps(choice.as_json(), indent=1) if args.json else choice.as_text())
    return EXIT_OK


def _gpt(args: Any) -> tuple[Any, tuple, dict, str]:
    """nvtp's GPT of ``--config`` on the meta device (bf16), with the whole batch (``--batch``, default the config's)."""
    try:
        cfg = gpt.config(args.config)
    except ValueError as e:
        raise Usage(str(e)) from None
    cfg = replace(cfg, n_layer=args.layers or cfg.n_layer, batch=args.batch or cfg.batch)
    with torch.device("meta"):
        model = gpt.GPT(cfg).to(torch.bfloat16)
    idx, targets = (t.to("meta") for t in gpt.example_tokens(cfg))
    name = f"GPT {args.config} ({cfg.n_layer} layers, hidden {cfg.n_embd}, sequence {cfg.seq_len}, batch {cfg.batch}, bf16)"
    return model, (idx, targets), {}, name


__all__ = ["explain_auto"]
