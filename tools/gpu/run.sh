# Runs on the device after install. $1: where the output goes.
set -u
O=$1
T=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")
g++ -O2 -shared -fPIC tools/gpu/shim.cpp -o /tmp/gpu/libc10shim.so -L$T/lib -lc10 -Wl,-rpath,$T/lib
export LD_PRELOAD=/tmp/gpu/libc10shim.so PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 tools/gpu/smoke.py 2>&1 | tee $O/smoke.txt
D=.gpu3/dumps
ALL="$D/fp32/*.py $D/bf16/*.py $D/bf16g/*.py fusions/nanogpt_gpt2_bf16_fwd.py fusions/nanogpt_gpt2_bf16_bwd.py"
for f in $ALL; do echo "== nvtp replay $f --backend nvfuser --check"; timeout 300 python3 -m nvtp replay $f --backend nvfuser --check 2>&1 | tail -8; echo "rc=${PIPESTATUS[0]}"; done 2>&1 | tee $O/replay_cli.txt
timeout 300 python3 tools/gpu/gpu_check.py $ALL 2>&1 | tee $O/from_text.txt
python3 tools/gpu/eager_time.py 2>&1 | tail -3 | tee $O/eager.txt
timeout 300 python3 -m pytest -m gpu -q --tb=line -p no:cacheprovider tests/test_ops.py 2>&1 | tail -8 | tee $O/pytest_gpu.txt
python3 -m nvtp shard $D/fp32/nanogpt_tiny_fp32_fwd.py --plan megatron --devices 1 --out /tmp/s1.py > /dev/null 2>&1
RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_SIZE=1 MASTER_ADDR=localhost MASTER_PORT=29511 timeout 120 python3 -X faulthandler tools/gpu/gpu_check.py /tmp/s1.py 2>&1 | grep -v "^  File .*site-packages/torch" | tail -30 | tee $O/sharded1.txt
