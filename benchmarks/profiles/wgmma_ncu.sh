#!/usr/bin/env bash
# Nsight Compute on one launch of each sm90 wgmma prefill: the CUDA backend's default-mode kernel
# (fp8kv_prefill_wgmma, 1 x 16384 causal, bf16 queries) and the Hopper backend's FP8-mode kernel
# (fp8kv_fp8_prefill, 4 x 2048 over 2048). Pipe utilisation (tensor/GMMA, XU = MUFU, ALU, FMA), shared
# memory traffic (LSU wavefronts and the shared-memory throughput of the memory tables, where the
# wgmma operand reads count), issue activity and stall reasons per issued instruction.
# Usage: bash benchmarks/profiles/wgmma_ncu.sh OUT_DIR
set -uo pipefail
out=$1
stalls=""
for s in barrier short_scoreboard long_scoreboard wait math_pipe_throttle mio_throttle not_selected selected \
         dispatch_stall lg_throttle branch_resolving no_instruction misc sleeping membar; do
  stalls+="smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio,"
done
metrics="${stalls}gpu__time_duration.sum,smsp__inst_executed.sum,sm__issue_active.avg.pct_of_peak_sustained_active,\
sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,\
sm__warps_active.avg.pct_of_peak_sustained_active"
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis"
ncu --kernel-name fp8kv_prefill_wgmma --launch-skip 1 --launch-count 1 --print-details all $sections \
  --metrics "$metrics" python benchmarks/prefill.py --profile default --shapes 1x16384+0 > "$out/ncu_cuda_wgmma_16k_causal.txt" 2>&1
ncu --kernel-name fp8kv_fp8_prefill --launch-skip 1 --launch-count 1 --print-details all $sections \
  --metrics "$metrics" python benchmarks/prefill.py --profile fp8 --shapes 4x2048+2048 > "$out/ncu_hopper_fp8_4x2048.txt" 2>&1
