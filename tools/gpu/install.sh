# Sourced on the lent GPU machine, from the repo root: install nvFuser and Thunder from the
# carried .gpu/ once (nvf.tar.xz: the nvfuser-cu130-torch210 wheel's files, xz-compressed to fit
# one call's 64 MiB; Thunder 0.2.6 and the pure-Python packages it needs), build the ABI shim, and
# export what Python needs to load them.
if [ ! -d /tmp/site/nvfuser_direct ]; then
  mkdir -p /tmp/site
  tar xJf .gpu/nvf.tar.xz -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl
  T=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")
  g++ -O2 -shared -fPIC tools/gpu/shim.cpp -o /tmp/site/libc10shim.so -L$T/lib -lc10 -Wl,-rpath,$T/lib
fi
export LD_PRELOAD=/tmp/site/libc10shim.so PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
