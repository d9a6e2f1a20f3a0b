#!/usr/bin/env bash
# Nsight Compute on one launch of the CUDA backend's mma.sync prefill kernel (4 x 2048 over 2048; below sm90,
# where it is the default-mode prefill):
# instructions by opcode, stall reasons per issued instruction, pipe utilisation, shared-memory
# bank conflicts. Usage: bash benchmarks/profiles/prefill_ncu.sh OUT.txt
set -euo pipefail
stalls=""
for s in barrier short_scoreboard long_scoreboard wait math_pipe_throttle mio_throttle not_selected selected \
         dispatch_stall lg_throttle branch_resolving no_instruction misc; do
  stalls+="smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio,"
done
ncu --kernel-name fp8kv_prefill_mma --launch-skip 1 --launch-count 1 --print-details all \
  --metrics "${stalls}sass__inst_executed_per_opcode,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,gpu__time_duration.sum" \
  python benchmarks/prefill.py --profile default --shapes 4x2048+2048 > "$1" 2>&1
