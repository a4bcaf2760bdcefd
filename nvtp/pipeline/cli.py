"""``nvtp explain --mesh PPxDPxTP``: a pipeline's plan before you have the machines.

    nvtp explain --model nanogpt --config gpt2 --layers 8 --plan megatron --mesh 4x2x2 --microbatches 8
    nvtp explain --module pkg.mod:factory --plan megatron --mesh 2x1x2 --microbatches 4 [--json]

The model is built on the meta device (nothing is allocated, a GPT-3 layer costs nothing), traced
and cut by the compile driver (``nvtp.driver.compile_pipeline``), and reported by
``PipelineProgram.as_text`` / ``as_data``: what ``nvtp.jit`` on that mesh runs.
"""

from __future__ import annotations

import json
import importlib

import torch

from nvtp import pipeline
from nvtp.errors import EXIT_OK, Usage
from nvtp.models import gpt
from nvtp.sharding.axes.pp import parse
from nvtp.sharding.plans import check_plan


def explain_pipeline(args) -> int:
    lay = parse(args.mesh)
    check_plan(args.plan, [])
    if args.fsdp:
        raise Usage("--fsdp is not available with a pipeline mesh (PPxDPxTP): its dp axis is DDP-style")
    microbatches = args.microbatches or lay.pp
    backend = "reference" if args.backend == "auto" else args.backend
    if args.module:
        mod_name, _, attr = args.module.partition(":")
        made = getattr(importlib.import_module(mod_name), attr)()
        model, example = made[0], made[1]
        name = type(model).__name__
    else:
        try:
            cfg = gpt.config(args.config)
        except ValueError as e:
            raise Usage(str(e)) from None
        batch = args.batch or microbatches
        cfg = gpt.config(args.config, n_layer=args.layers or cfg.n_layer, batch=batch, dropout=0.0)
        with torch.device("meta"):
            model = gpt.GPT(cfg)
        example = (torch.zeros(batch, cfg.seq_len, dtype=torch.long), torch.zeros(batch, cfg.seq_len, dtype=torch.long))
        name = f"nvtp's GPT ({args.config}, {cfg.n_layer} layers, each rank's batch {batch})"
    program = pipeline.plan(model, *example, plan=args.plan, mesh=lay, microbatches=microbatches, schedule=args.schedule or "1f1b",
                            backend=backend)
    print(json.dumps(program.as_data(), indent=1) if args.json else program.as_text(name))
    return EXIT_OK
