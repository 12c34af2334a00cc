R=$OUT; export OUT=/tmp/o; mkdir -p $OUT
for v in v18 v20; do xz -d build-gpu/ab/$v/libforkattn.so.0.xz; done
ROUNDS=2 bash bench/gpu_ab.sh build-gpu v18=build-gpu/ab/v18 v20=build-gpu/ab/v20 v21=build-gpu > /dev/null 2>&1
cat $OUT/ab.txt
mkdir -p /tmp/o2; OUT=/tmp/o2 FORKATTN_SKIP_SANITIZER=1 bash bench/gpu_suite.sh build-gpu > /tmp/o2/suite_stdout.txt 2>&1; echo "suite rc=$?"
cat /tmp/o2/tests.txt; cp /tmp/o2/tests.txt $OUT/suite_tests.txt; cp /tmp/o2/bench.txt $OUT/suite_bench.txt 2>/dev/null; cp /tmp/o2/logs.tgz $OUT/suite_logs.tgz 2>/dev/null
OMP_TARGET_OFFLOAD=mandatory FORKATTN_GPU_MMA=1 timeout 280 bash bench/gpu_run.sh python3 bench/compare_torch.py --lib build-gpu/libforkattn.so.0 --reps 20 --commit v21-wip --json $OUT/compare_torch.json --results $OUT/RESULTS-compare_torch.md > $OUT/compare_torch.txt 2>&1; echo "compare rc=$?"
tail -30 $OUT/compare_torch.txt
tar czf $R/all.tgz -C $OUT .
