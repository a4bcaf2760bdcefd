"""Train the small GPT sharded with nvtp under torchrun (or any launcher that sets RANK and
WORLD_SIZE):

    torchrun --nproc-per-node 4 tools/train.py --plan megatron --steps 20

Each rank joins the default process group (gloo on CPU, NCCL on GPUs), wraps the model with
``nvtp.jit`` and trains; rank 0 prints the progress.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from nvtp.demo import TrainJob, train_worker


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default="megatron")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--save-dir", default=None)
    p.add_argument("--load-dir", default=None)
    p.add_argument("--out", default=None, help="rank 0 writes the losses and the whole final parameters here (torch.save)")
    args = p.parse_args()
    if args.save_at is not None and not args.save_dir:
        p.error("--save-at needs --save-dir (where to write the checkpoint)")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    with tempfile.TemporaryDirectory() as tmp:
        job = TrainJob("tiny", args.plan, args.steps, args.lr, args.out or os.path.join(tmp, "result.pt"), optimizer=args.optimizer,
                       save_at=args.save_at, save_dir=args.save_dir, load_dir=args.load_dir)
        return train_worker(rank, world, None, job)


if __name__ == "__main__":
    sys.exit(main())
