# One lent-GPU session in one call (device time is short): install nvFuser and Thunder from the
# carried .gpu/ (tools/gpu/install.sh), then the correctness checks side by side (they share the GPU,
# none is timed), then the timing alone. $1: where the output goes; $2: seconds for the whole call.
set -u
O=$1
END=$(( $(date +%s) + ${2:-560} ))
left() { echo $(( END - $(date +%s) )); }
source tools/gpu/install.sh
nvidia-smi -L | tee $O/device.txt
python3 tools/gpu/smoke.py 2>&1 | tail -2 | tee -a $O/device.txt
echo "installed, $(left) s left"
# correctness, side by side
P=$(( $(left) * ${3:-45} / 100 ))
for m in gpt moe llama; do timeout $P python3 tools/gpu/jit_nvfuser.py parity $m > $O/parity_$m.txt 2>&1 & done
timeout $P python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_driver.py tests/test_ops.py tests/test_launch.py > $O/pytest.txt 2>&1 &
timeout $P python3 tools/gpu/jit_nvfuser.py profile > $O/profile.txt 2>&1 &
wait
for f in $O/parity_*.txt; do echo "== $f"; grep -E "^(PARITY|program|step  1|step 10)" $f || tail -5 $f; done
tail -3 $O/pytest.txt; grep -E "^PROFILE" $O/profile.txt || tail -3 $O/profile.txt
echo "correctness done, $(left) s left"
# timing, alone
timeout $(( $(left) - 5 )) python3 tools/gpu/jit_nvfuser.py bench 2 ${4:-eager,nvtp,compile,thunder} 2>&1 | tee $O/bench.txt
echo "end, $(left) s left"
