"""Where nvFuser's Communicator fails under a launcher: prints the launcher's variables, then each step."""
import faulthandler
import os

faulthandler.enable(all_threads=True)
print("env", {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}, flush=True)
import torch  # noqa: E402,F401

print("step: import nvfuser_direct", flush=True)
import nvfuser_direct  # noqa: E402

print("step: Communicator.instance()", flush=True)
c = nvfuser_direct.multidevice.Communicator.instance()
print("communicator", c.size(), c.rank(), flush=True)
