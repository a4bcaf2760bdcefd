"""The launcher's ranks (``nvtp.execute.launch.spawn``): forked from a server that imported torch,
Thunder (where no GPU is) and nvtp once, each given the launcher's environment and standard streams as they are at
its launch, as a freshly spawned process would have them."""

import os
import sys

import torch

from nvtp.execute import launch

KEY = "NVTP_TEST_LAUNCH_VALUE"


def _report(rank: int, world: int, init_method: str) -> int:
    print(f"rank {rank} of {world}: {os.environ.get(KEY)} parent={os.getppid()} thunder={'thunder' in sys.modules} "
          f"cuda_usable={not torch.cuda._is_in_bad_fork()}", flush=True)
    return 0


def test_each_launch_gives_its_ranks_the_launchers_environment_and_output(capfd, monkeypatch):
    for value in ("first", "second"):  # the second launch reuses the server the first one started
        monkeypatch.setenv(KEY, value)
        codes = launch.spawn(_report, 2)
        assert list(codes) == [0, 0], codes.summary()
        lines = sorted(line for line in capfd.readouterr().out.splitlines() if line.startswith("rank "))
        assert [line.split(": ")[0] for line in lines] == ["rank 0 of 2", "rank 1 of 2"], lines  # printed here
        fields = [dict(f.split("=") for f in line.split()[5:]) | {"value": line.split()[4]} for line in lines]
        assert [f["value"] for f in fields] == [value, value]  # the environment at this launch
        assert all(f["parent"] != str(os.getpid()) for f in fields), fields  # forked by the server, not spawned here
        gpu = torch.cuda.is_available()
        # which imported torch, and Thunder where no GPU is (importing Thunder counts CUDA devices: a process
        # forked after that cannot use CUDA)
        assert all(f["thunder"] == str(not gpu) for f in fields), fields
        assert not gpu or all(f["cuda_usable"] == "True" for f in fields), fields
