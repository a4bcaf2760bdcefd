# On the lent GPU machine, from the repo root: install nvFuser and Thunder (tools/gpu/install.sh),
# then run $2 (a list of steps: parity profile bench pytest). $1: where the output goes.
set -u
O=$1
shift
source tools/gpu/install.sh
nvidia-smi -L
python3 tools/gpu/smoke.py 2>&1 | tail -2
for step in "$@"; do
  case $step in
    pytest) timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_driver.py tests/test_ops.py 2>&1 | tail -15 | tee $O/pytest.txt ;;
    *) timeout 400 python3 tools/gpu/jit_nvfuser.py $step 2>&1 | tee $O/$step.txt ;;
  esac
done
