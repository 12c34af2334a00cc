export LD_LIBRARY_PATH=$PWD/build-wgc OMP_TARGET_OFFLOAD=mandatory FORKATTN_BACKEND=gpu
for v in one two; do
  e=FORKATTN_GPU_WG2=1; [ $v = one ] && e=FORKATTN_GPU_WG2=0
  env $e timeout 200 bash bench/gpu_run.sh ncu --clock-control none -k regex:mma_dkv --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section SourceCounters \
    --section InstructionStats --import-source no -o /tmp/rep_$v \
    build-wgc/forkattn bench prefix --backend gpu --no-replicated --n 1 --p 4096 --r 0 --hq 16 --hkv 16 --d 128 --dtype bf16 --repeats 1 > $OUT/ncu_$v.txt 2>&1
  echo "$v rc=$?"
  timeout 60 bash bench/gpu_run.sh ncu -i /tmp/rep_$v.ncu-rep --page details > $OUT/details_$v.txt 2>&1
  timeout 100 bash bench/gpu_run.sh ncu -i /tmp/rep_$v.ncu-rep --page source --csv --print-source sass > $OUT/sass_$v.csv 2>&1
  grep -E "Duration|Registers|Warp Cycles Per Issued|Issued Ipc|No Eligible|Achieved Occupancy|Stall" $OUT/details_$v.txt | head -30
done
ls -la $OUT
