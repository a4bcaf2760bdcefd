"""The ``nvtp`` command line: dump, replay, shard, explain and demo.

Every failure ends in one line on stderr, ``nvtp COMMAND: what went wrong`` (ranks of a mesh
print ``nvtp: rank r failed: ...`` / ``nvtp: rank r stopping: rank k failed: ...``), and an exit
code saying whose fault it was (``nvtp --help``). ``NVTP_DEBUG=1`` adds the Python traceback of
an unexpected error.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import importlib
import importlib.util
import json
import traceback

import torch

from nvtp.sharding import axes
from nvtp.errors import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_CHECK_FAILED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, Usage
from nvtp.options import check_cli
from nvtp.errors import RankFailure, bad_input_types
from nvtp.execute import backends

# Each command imports its own modules when it runs ("# lazy: the command's module"): `nvtp --help`
# loads none of them (they add about 0.6 s), and no command loads Thunder unless it traces a model.

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_CHECK_FAILED", "EXIT_USAGE", "EXIT_BAD_INPUT", "EXIT_RUNTIME"]

EPILOG = """\
exit codes:
  0  success
  1  a --check found results outside tolerance
  2  usage error (bad command-line arguments)
  3  bad input, refused before any work: a dump nvtp cannot read (file:line and what was
     expected), a plan or mesh that does not fit (tensor, axis, sizes and the fix), inputs
     unlike the compiled ones, a replay too big for this machine
  4  failure at run time: an op failed, a rank died or hung (the first to fail is named;
     the others stop within --timeout seconds), a GPU is needed
  141  the reader of nvtp's output went away (`nvtp explain ... | head -1`): nvtp stops
     quietly, as a command killed by SIGPIPE does (128 + 13); a replay on a mesh of
     processes finishes its check silently instead and exits with the check's verdict

examples:
  nvtp demo                                   shard a GPT block over a local CPU mesh and check it
  nvtp dump --model nanogpt --config gpt2 --out fusions
  nvtp replay fusions/nanogpt_gpt2_bf16_fwd.py --check
"""


def _dtype(name: str):
    from nvtp.dump import DTYPES  # lazy: the command's module

    try:
        return DTYPES[name]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def cmd_dump(args) -> int:
    from nvtp import dump  # lazy: the command's module

    start = time.perf_counter()
    fwd, bwd = dump.dump_model(args.model, args.config, args.out, dtype=args.dtype, dropout=args.dropout)
    print(f"wrote {fwd} and {bwd} in {time.perf_counter() - start:.1f} s")
    return EXIT_OK


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _seconds(text: str) -> float:
    try:
        t = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < t < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds more than 0, got {text}")
    return t


def _load_sharded(args, backend: str):
    """The sharded fusion of ``args.file`` under ``args.plan`` on ``args.devices`` (or ``args.mesh``, DPxTP),
    sharded by the compile driver for ``backend``'s target."""
    from nvtp.dump.mesh import MeshJob, check_mesh_options, prepare  # lazy: the command's module

    mesh = check_mesh_options(args.devices, args.mesh, args.fsdp)
    return prepare(MeshJob(args.file, args.plan, args.devices, mesh=mesh, fsdp=args.fsdp, backend=backend)).sharded


def _ring_mode(args) -> bool | str:
    from nvtp.sharding.collective_matmul import SPELLED  # lazy: the command's module

    return SPELLED[getattr(args, "collective_matmul", "auto")]


def _planning_backend(args) -> str:
    """``--backend``, or the one ``nvtp.jit`` would run a model on here: nvFuser on a machine where
    it runs (a CUDA GPU and nvfuser_direct), the reference backend otherwise."""
    if args.backend != "auto":
        return args.backend

    return backends.default_name("cuda" if torch.cuda.is_available() else "cpu")


def cmd_shard(args) -> int:
    from nvtp.dump.sharded import mesh_text, write_sharded  # lazy: the command's module

    if args.devices is None and args.mesh is None:
        raise Usage("give --devices N (a 1-D mesh) or --mesh DPxTP (a 2-D mesh: dp x tp, e.g. --mesh 2x2)")
    sharded = _load_sharded(args, "nvfuser")  # the file nvFuser runs: sharded for nvFuser's target
    where = f"--devices {args.devices}" if args.mesh is None else f"--mesh {args.mesh}{' --fsdp' if args.fsdp else ''}"
    command = f"nvtp shard {args.file} --plan {args.plan} {where} --out {args.out}"
    data = None if args.mesh is None else axes.data_mode(args.fsdp)
    path = write_sharded(sharded, args.out, command, data=data)
    comms = sharded.communications
    mesh = sharded.mesh
    on = (lambda c: "") if mesh.ndim == 1 else (lambda c: f" on {mesh.names[c.axis]}")
    devices = f"{mesh.size} devices" if mesh.ndim == 1 else f"a {mesh_text(mesh)} mesh ({', '.join(mesh.names)})"
    print(f"wrote {path}: {len(list(sharded.fusion.compute_ops()))} ops for {devices}, "
          f"{len(comms)} communication(s): {', '.join(c.kind + on(c) for c in comms) or 'none'}")
    return EXIT_OK


def cmd_explain(args) -> int:
    from nvtp.sharding import report  # lazy: the command's module

    if (args.model or args.module) and args.file is not None:
        raise Usage(f"give either a dump FILE ({args.file}) or --model/--module, not both")
    if args.plan == "auto":  # the planner chooses the mesh and its options (nvtp.auto)
        from nvtp.auto.cli import explain_auto  # lazy: loads Thunder; CLI file commands load this module without it

        if not (args.model or args.module):
            raise Usage("--plan auto plans a whole model: give --model nanogpt [--config NAME --layers L --batch B] or --module pkg.mod:factory")
        if args.capacity_factor is not None:
            raise Usage(f"--capacity-factor {args.capacity_factor:g} is not one of the options --plan auto chooses; give --plan and --mesh with an ep axis")
        return explain_auto(args, vars(build_parser().parse_args(["explain", "--plan", "auto"])), _planning_backend(args), _load_factory)
    if args.memory is not None:
        raise Usage(f"--memory {args.memory} is the budget --plan auto plans for; with --plan {args.plan} leave it out")
    if args.capacity_factor is not None and not args.module:
        raise Usage(f"--capacity-factor {args.capacity_factor:g} applies to a model with mixture-of-experts layers on an ep axis: "
                    "give it with --module pkg.mod:factory")
    if args.devices is None and args.mesh is None:
        raise Usage("give --devices N (a 1-D mesh) or --mesh DPxTP (a 2-D mesh: dp x tp, e.g. --mesh 2x2)")
    if args.batch is not None and not args.model:
        raise Usage(f"--batch {args.batch} applies to --model nanogpt; with --module the factory's example arguments are one rank's batch")
    if args.mesh is not None and str(args.mesh).lower().count("x") == 2:
        from nvtp.pipeline.cli import explain_pipeline  # lazy: the command's module

        return explain_pipeline(args)
    if args.model or args.module:
        return _explain_model(args)
    if args.file is None:
        raise Usage("give a dump FILE, or a whole model: --model nanogpt --config NAME [--layers L], or --module pkg.mod:factory")
    backend = _planning_backend(args)
    sharded = _load_sharded(args, backend)
    if args.json:
        print(json.dumps(report.as_json(sharded, args.file) | {"backend": backend}, indent=1))
    else:
        print(report.as_text(sharded, args.file, backend))
    return EXIT_OK


def _load_factory(spec: str):
    """(model, example_args, example_kwargs) of ``--module pkg.mod:factory``; ``pkg.mod`` is
    looked for on the path and then in the current directory (a user's own file beside them)."""
    mod_name, _, attr = spec.partition(":")
    if not attr:
        raise Usage(f"--module takes pkg.mod:factory, got {spec!r}")
    # `python -m nvtp` finds a module in the current directory (sys.path[0] is ''), the `nvtp`
    # console script did not (its sys.path[0] is its bin directory): the same command failed with
    # "No module named". Appended, not prepended, so a file there never shadows an installed package.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise Usage(f"--module {spec}: {e}") from None
    made = factory()
    if not (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], torch.nn.Module)
            and (len(made) == 2 or isinstance(made[2], dict))):
        raise Usage(f"--module {spec}: the factory must return (model, example_args) or (model, example_args, "
                    f"example_kwargs), got {type(made).__name__}")
    return made if len(made) == 3 else (*made, {})


def _explain_model(args) -> int:
    """``explain --model nanogpt --config C [--layers L]`` (regional: one block traced, counted L
    times) or ``--module pkg.mod:factory`` (the factory returns ``(model, example_args)`` or ``(model, example_args, example_kwargs)``; traced as
    nvtp.jit traces it). ``--devices N`` or ``--mesh DPxTP [--fsdp]``."""
    from nvtp import explain  # lazy: the command's module
    from nvtp.dump.mesh import check_mesh_options  # lazy: the command's module
    from nvtp.sharding.plans import check_plan  # lazy: the command's module

    mesh = check_mesh_options(args.devices, args.mesh, args.fsdp)  # (dp, tp) or None; bad spellings refused here
    check_plan(args.plan, [])  # a misspelt plan name, before the factory runs or anything is traced
    where = dict(devices=args.devices) if mesh is None else dict(mesh=mesh, fsdp=args.fsdp)
    backend = _planning_backend(args)
    if args.module:
        model, example, example_kwargs = _load_factory(args.module)
        result = explain.plan(model, *example, plan=args.plan, backend=None if args.backend == "auto" else backend, **where,
                              machine=args.machine, collective_matmul=_ring_mode(args), capacity_factor=args.capacity_factor,
                              **example_kwargs)
    else:
        from nvtp.models import gpt  # lazy: the command's module

        try:
            cfg = gpt.config(args.config)
        except ValueError as e:
            raise Usage(str(e)) from None
        layers = args.layers or cfg.n_layer
        result = explain.explain_gpt(cfg, layers=layers, plan=args.plan, batch=args.batch, backend=backend, machine=args.machine,
                                     collective_matmul=_ring_mode(args), **where)
    if args.machine is not None:
        from nvtp.sharding.cost import MACHINES  # lazy: the command's module

        result.machine = MACHINES[args.machine]
    print(json.dumps(result.as_json(), indent=1) if args.json else result.as_text())
    return EXIT_OK


def cmd_replay(args) -> int:
    from nvtp import dump  # lazy: the command's module

    if args.plan is not None or (args.devices or 1) > 1 or args.mesh is not None or args.fsdp or _has_schedule(args.file):
        from nvtp.dump.mesh import MeshJob, check_mesh_options, run  # lazy: the command's module

        mesh = check_mesh_options(args.devices, args.mesh, args.fsdp)
        # The mesh replay runs on the reference backend, and --plan shards for what runs.
        return run(MeshJob(args.file, args.plan, args.devices, args.seed, args.check, args.timeout, mesh=mesh, fsdp=args.fsdp))
    from nvtp.dump.mesh import check_memory  # lazy: the command's module

    d = dump.load(args.file)
    fusion = d.fusion
    check_memory(fusion, args.file, check=args.check)
    if args.backend == "nvfuser":
        if not torch.cuda.is_available():
            print("nvtp replay: --backend nvfuser executes with nvFuser, which needs a CUDA GPU; this machine has none. "
                  "Use --backend reference (the default) to run the dump here.", file=sys.stderr)
            return EXIT_RUNTIME
    report = dump.replay(fusion, backend=args.backend, seed=args.seed, check=args.check)
    n_ops = len(list(fusion.compute_ops()))
    print(f"{args.file}: {n_ops} ops, {len(fusion.inputs)} inputs, {len(fusion.outputs)} outputs; ran in {report.seconds:.3f} s on {args.backend}")
    if not args.check:
        return EXIT_OK
    print(f"{'output':>10}  {'dtype':>8}  {'shape':<20} {'rel. error':>11}  {'max |diff|':>11}  {'tolerance':>9}")
    for c in report.checks:
        row = f"{c.name:>10}  {c.dtype.value:>8}  {str(list(c.shape)):<20} "
        if c.compared:
            print(row + f"{c.rel_error:11.3e}  {c.max_abs:11.3e}  {c.tolerance:9.0e}  {'ok' if c.ok else 'FAIL'}")
        else:
            print(row + f"{'-':>11}  {'-':>11}  {'-':>9}  not compared ({c.not_compared})")
    for line in dump.verdict(fusion, report):
        print(line)
    return EXIT_OK if report.ok else EXIT_CHECK_FAILED


def _has_schedule(path: str) -> bool:
    from nvtp import dump  # lazy: the command's module

    try:
        return bool(dump.load(path).schedule)
    except Exception:  # noqa: BLE001 - the replay itself reports a bad file, with its line
        return False


DEMO_PLANS = ("megatron", "megatron-sp", "replicate")


def cmd_demo(args) -> int:
    # Bad arguments are refused once, here, before any rank starts or anything is traced: a
    # misspelt plan name at once (before torch is even imported), a glob that names nothing or
    # a mesh the plan cannot split as soon as the GPT is built (demo.check_job).
    if args.plan not in DEMO_PLANS and "=" not in args.plan:
        print(f"nvtp demo: unknown plan {args.plan!r}; use {', '.join(DEMO_PLANS)}, or an explicit plan 'glob=placement;...' "
              "(placements S(d), S(d,k), R, colwise, rowwise)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.model != "nanogpt":
        if importlib.util.find_spec("transformers") is None:
            print(f"nvtp demo: --model {args.model} needs transformers, which is not installed; run `uv sync` (the dev group "
                  "installs it) or `pip install nvtp[hf]`", file=sys.stderr)
            return EXIT_BAD_INPUT
    if args.mesh is not None and str(args.mesh).lower().count("x") == 2:  # PPxDPxTP: a pipeline (nvtp/pipeline/demo.py)
        from nvtp.sharding.axes.pp import parse  # lazy: the command's module

        parse(args.mesh)  # a bad spelling refused here
        from nvtp.pipeline import demo as pipeline_demo  # lazy: the command's module

        return pipeline_demo.main(args)
    from nvtp.dump.mesh import check_mesh_options  # lazy: the command's module

    # --mesh with --devices, a bad spelling, --fsdp without --mesh: refused here (exit 3).
    args.mesh_shape = check_mesh_options(args.devices, args.mesh, args.fsdp)
    if args.devices is None and args.mesh_shape is None:
        args.devices = 4
    from nvtp import demo  # lazy: the command's module

    return demo.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nvtp",
        description="Turn a single-device PyTorch transformer into a tensor-parallel program for nvFuser.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser("dump", help="trace a model's block and write its forward and backward fusions")
    d.add_argument("--model", default="nanogpt", choices=["nanogpt"])
    d.add_argument("--config", default="tiny", choices=["tiny", "gpt2", "gpt3"])
    d.add_argument("--dtype", default="bf16", type=_dtype, help="bf16 (default), fp16 or fp32")
    d.add_argument("--dropout", type=float, default=None, help="override the config's dropout probability")
    d.add_argument("--out", required=True, help="directory to write the two files into")
    d.set_defaults(fn=cmd_dump)

    r = sub.add_parser("replay", help="run a dump on random inputs, optionally checking it against eager PyTorch in float64")
    r.add_argument("file")
    r.add_argument("--check", action="store_true", help="compare every output with an independent evaluation in eager PyTorch, float64")
    r.add_argument("--backend", default="reference", choices=["reference", "nvfuser"])
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--plan", default=None, help="shard with this plan: megatron, megatron-sp, or 'glob=placement;...'")
    r.add_argument("--devices", type=_positive_int, default=None, help="run on a local mesh of N processes (gloo on CPU)")
    r.add_argument("--mesh", default=None, metavar="DPxTP",
                   help="run on a local 2-D mesh (dp, tp) of DP*TP processes, e.g. 2x2: --plan on tp, the batch split over dp")
    r.add_argument("--fsdp", action="store_true", help="with --mesh: split the weights over dp too (FSDP / ZeRO-3)")
    r.add_argument("--timeout", type=_seconds, default=60.0,
                   help="seconds a rank waits for a silent peer before the mesh stops (default 60); a rank that dies stops the others at once")
    r.set_defaults(fn=cmd_replay)

    for name, fn, helptext in [("shard", cmd_shard, "write the sharded fusion, with its device schedule, in nvFuser's format"),
                               ("explain", cmd_explain, "show each tensor's sharding and every communication with its bytes")]:
        c = sub.add_parser(name, help=helptext)
        c.add_argument("file", nargs="?" if name == "explain" else None, default=None)
        c.add_argument("--plan", required=True, help="megatron, megatron-sp, or 'glob=placement;...' (placements S(d), S(d,k), R, colwise, rowwise)"
                                                        + ("; auto: nvtp chooses the mesh and its options for --devices N" if name == "explain" else ""))
        c.add_argument("--devices", type=_positive_int, default=None, help="a 1-D mesh of N devices (or --mesh DPxTP)")
        c.add_argument("--mesh", default=None, metavar="DPxTP",
                       help="a 2-D mesh (dp, tp), e.g. 2x2: the plan on tp (mesh_x), the batch split over dp (mesh_y); "
                            "or named axes, e.g. cp=4 or cp=2,tp=2 (context parallel: the sequence split, attention by ring)")
        c.add_argument("--fsdp", action="store_true", help="with --mesh: split the weights over dp too (FSDP / ZeRO-3)")
        c.add_argument("--microbatches", type=_positive_int, default=None, help="with --mesh PPxDPxTP: microbatches per step")
        c.add_argument("--schedule", default=None, choices=["1f1b", "gpipe"], help="with --mesh PPxDPxTP: the pipeline schedule (default 1f1b)")
        if name == "shard":
            c.add_argument("--out", required=True, help="file to write")
        else:
            c.add_argument("--json", action="store_true", help="print one JSON object (with a 'communications' list)")
            c.add_argument("--collective-matmul", default="auto", choices=["auto", "on", "off"],
                           help="run megatron-sp's gathers and reduce-scatters around the projections as ring steps beside "
                                "the matmul: auto where the cost model says it pays on --machine (default: the backend's), "
                                "on everywhere, off never")
            c.add_argument("--machine", default=None, choices=["h100-nvlink", "h100-ib", "cpu-gloo"],
                           help="estimate, on this machine model, what the communication schedule hides per step "
                                "(h100-nvlink: 8x H100 in one node; h100-ib: nodes of 8 over InfiniBand, the mesh's last axis fastest)")
            c.add_argument("--capacity-factor", type=float, default=None, metavar="C",
                           help="with an ep axis (--mesh ep=N): each expert takes at most ceil(C x a rank's routed tokens x top_k "
                                "/ experts) of a rank's tokens, the later ones dropped (Megatron-Core's 'position' policy); "
                                "default: dropless")
            c.add_argument("--memory", default=None, help="with --plan auto: the memory budget per device, e.g. 80GB or 24GiB "
                                                              "(default: the --machine's device memory)")
            c.add_argument("--backend", default="auto", choices=["auto", "reference", "nvfuser"],
                           help="the backend to plan for: auto (default) is the one nvtp.jit would run the model on here "
                                "(nvfuser with a CUDA GPU and nvFuser, else reference); nvfuser plans for GPUs on any machine")
            c.add_argument("--model", choices=["nanogpt"], help="explain a whole model instead of a dump (with --config, --layers)")
            c.add_argument("--config", default="gpt3", help="the model's config: tiny, gpt2 or gpt3 (default gpt3)")
            c.add_argument("--layers", type=_positive_int, default=None, help="layers (default: the config's)")
            c.add_argument("--batch", type=_positive_int, default=None,
                           help="with --model: each rank's batch (default the config's); on --mesh DPxTP the traced batch is DP times it")
            c.add_argument("--module", help="explain pkg.mod:factory's model (factory() returns (model, example_args) or (model, example_args, "
                                                 "example_kwargs): one rank's batch on --mesh; e.g. nvtp.models.hf:llama3_70b, or mymodel:make for "
                                                 "a mymodel.py in the current directory); "
                                                 "a chain of repeated blocks is traced as one block and the model without them, then spliced, as nvtp.jit does")
        c.set_defaults(fn=fn)

    m = sub.add_parser("demo", help="the main job: train a small GPT (or --model llama: a transformers model) sharded over a local CPU mesh, checked against one process")
    m.add_argument("--devices", type=_positive_int, default=None, help="processes in the local 1-D mesh (default 4)")
    m.add_argument("--mesh", default=None, metavar="DPxTP",
                   help="a local 2-D mesh (dp, tp) of DP*TP processes instead, e.g. 2x2: the plan on tp, each dp rank "
                        "training on its part of the batch (DDP), checked against one process on the whole batch; "
                        "or axes by name, e.g. cp=4 or cp=2,tp=2: the sequence split over cp, attention by ring")
    m.add_argument("--fsdp", action="store_true", help="with --mesh: split the weights over dp too (FSDP / ZeRO-3)")
    m.add_argument("--microbatches", type=_positive_int, default=None, help="with --mesh PPxDPxTP: microbatches per step (default 2)")
    m.add_argument("--schedule", default=None, choices=["1f1b", "gpipe"], help="with --mesh PPxDPxTP: the pipeline schedule (default 1f1b)")
    m.add_argument("--plan", default="megatron", help="megatron (default), megatron-sp, replicate, or 'glob=placement;...'")
    m.add_argument("--steps", type=_positive_int, default=20)
    m.add_argument("--config", default="tiny", choices=["tiny"], help="nvtp's GPT's config (with --model nanogpt)")
    m.add_argument("--model", default="nanogpt", choices=["nanogpt", "llama", "gpt2", "mistral", "qwen2"],
                   help="nanogpt (default: nvtp's GPT), or a small Hugging Face transformers model built from a config "
                        "(traced by the FX route; needs transformers)")
    m.add_argument("--timeout", type=_seconds, default=60.0,
                   help="seconds a rank waits for a silent peer before the mesh stops (default 60); a rank that dies stops the others at once")
    m.set_defaults(fn=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (never raises, never prints a traceback unless
    ``NVTP_DEBUG`` is set)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage error (or the help)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if not getattr(args, "fn", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        check_cli(args)  # every flag checked as the option it sets, before any work (nvtp/options.py)
        code = args.fn(args)
        sys.stdout.flush()  # a closed pipe shows here, not in Python's exit (which would print a traceback)
        return code
    except BrokenPipeError:
        # The reader closed stdout (`| head -1`): no message (nobody reads it) and the exit
        # status of a command killed by SIGPIPE, as coreutils give; stdout goes to /dev/null so
        # Python's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except bad_input_types() as e:
        print(f"nvtp {args.command}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Usage as e:
        print(f"nvtp {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RankFailure as e:
        print(f"nvtp {args.command}: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - an op failed, or a bug: one line, the traceback on request
        if os.environ.get("NVTP_DEBUG"):
            traceback.print_exc()
        text = str(e).strip()
        hint = "" if os.environ.get("NVTP_DEBUG") else " (NVTP_DEBUG=1 prints the traceback)"
        print(f"nvtp {args.command}: failed: {type(e).__name__}: {text}{hint}", file=sys.stderr)
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
