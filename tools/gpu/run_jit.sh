# On the lent GPU machine, from the repo root: install nvFuser and Thunder from the carried .gpu/
# (nvf.tar.xz: the nvfuser-cu130-torch210 wheel's files, xz-compressed to fit one call's 64 MiB;
# Thunder 0.2.6 and the pure-Python packages it needs), build the ABI shim, then run $2 (a list of
# steps: parity profile bench pytest). $1: where the output goes.
set -u
O=$1
shift
if [ ! -d /tmp/site/nvfuser_direct ]; then
  mkdir -p /tmp/site
  tar xJf .gpu/nvf.tar.xz -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl
  T=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")
  g++ -O2 -shared -fPIC tools/gpu/shim.cpp -o /tmp/site/libc10shim.so -L$T/lib -lc10 -Wl,-rpath,$T/lib
fi
export LD_PRELOAD=/tmp/site/libc10shim.so PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 tools/gpu/smoke.py 2>&1 | tail -2
for step in "$@"; do
  case $step in
    pytest) timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_driver.py tests/test_ops.py 2>&1 | tail -15 | tee $O/pytest.txt ;;
    *) timeout 400 python3 tools/gpu/jit_nvfuser.py $step 2>&1 | tee $O/$step.txt ;;
  esac
done
